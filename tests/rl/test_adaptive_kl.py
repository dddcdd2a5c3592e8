"""The adaptive KL coefficient is steered by the KL actually measured: with the KL as a
reward penalty, the rollout batch's KL to the reference; as a loss term, the update's KL
term. It rises while the KL is above its target and falls below it, in both modes."""
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.algos import KLController
from mcore_rl.config import RLConfig
from mcore_rl.data.batch import Batch
from mcore_rl.rl import phases


def _state(kl_in_reward: bool, coef: float = 0.1, target: float = 0.05):
    cfg = RLConfig()
    cfg.algorithm.kl_in_reward, cfg.algorithm.kl_estimator = kl_in_reward, "k1"
    return SimpleNamespace(cfg=cfg, reference=object(), kl=KLController(coef, target))


def _batch(log_ratio: float) -> Batch:
    """Two sequences whose response tokens have log pi - log ref = ``log_ratio`` (k1 KL)."""
    batch = Batch.from_sequences([[1, 2, 3, 4], [1, 2, 3]], prompt_lens=[2, 2])
    ref = torch.full(batch["input_ids"].shape, -2.0)
    return batch.with_tensors(rollout_logprobs=ref + log_ratio, ref_logprobs=ref,
                              token_rewards=torch.zeros(ref.shape))


@pytest.mark.parametrize("log_ratio, direction", [(0.5, 1), (0.01, -1)])
def test_kl_in_the_reward_steers_the_coefficient_by_the_rollout_kl(log_ratio, direction):
    state, batch = _state(kl_in_reward=True), _batch(log_ratio)
    batch = phases.kl_penalty(state, batch)
    # the penalty is coef * KL on response tokens only
    expected = torch.zeros_like(batch["token_rewards"])
    expected[batch["response_mask"].bool()] = -0.1 * log_ratio
    assert torch.allclose(batch["token_rewards"], expected)
    measured = phases.measured_kl(state, batch, update_metrics={})  # no actor/kl_loss needed
    assert measured == pytest.approx(log_ratio)
    before = state.kl.coef
    for _ in range(20):
        state.kl.update(measured, n_samples=100)
    assert (state.kl.coef - before) * direction > 0, (before, state.kl.coef)


@pytest.mark.parametrize("kl_loss, direction", [(0.5, 1), (0.01, -1)])
def test_kl_as_a_loss_steers_the_coefficient_by_the_updates_kl_term(kl_loss, direction):
    state, batch = _state(kl_in_reward=False), _batch(0.3)
    assert phases.kl_penalty(state, batch) is batch  # no reward penalty
    measured = phases.measured_kl(state, batch, update_metrics={"actor/kl_loss": kl_loss})
    assert measured == kl_loss
    before = state.kl.coef
    state.kl.update(measured, n_samples=100)
    assert (state.kl.coef - before) * direction > 0


def test_without_a_reference_there_is_no_kl_to_measure():
    state = _state(kl_in_reward=True)
    state.reference = None
    assert phases.measured_kl(state, _batch(0.5), {}) is None
