"""Advantage estimators on hand-checked cases."""
import math

import pytest
import torch

from mcore_rl.algos import ADVANTAGE_ESTIMATORS, AdvantageInputs
from mcore_rl.errors import UsageError


def outcome(scores, lengths, T=4):
    """Token rewards with each score on the last response token; responses start at col 1."""
    B = len(scores)
    rewards, mask = torch.zeros(B, T), torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, 1:1 + n] = 1
        rewards[i, n] = s
    return rewards, mask


def test_grpo_normalises_within_each_group_over_all_samples():
    rewards, mask = outcome([1.0, 0.0, 0.0, 3.0, 1.0], [2, 1, 3, 2, 2])
    group = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = ADVANTAGE_ESTIMATORS.get("grpo")(AdvantageInputs(rewards, mask, group))
    # group 0: scores 1,0,0 -> mean 1/3, unbiased std sqrt(1/3); group 1: 3,1 -> mean 2, std sqrt(2)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    expected = torch.tensor([(1 - 1 / 3) / s0, (0 - 1 / 3) / s0, (0 - 1 / 3) / s0, 1 / s1, -1 / s1])
    per_seq = adv.sum(-1) / mask.sum(-1)
    torch.testing.assert_close(per_seq, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(adv[mask == 0] == 0)
    assert torch.allclose(adv[0, 1:3], adv[0, 1])  # the same on every response token


def test_grpo_group_of_identical_scores_gives_zero_advantage():
    rewards, mask = outcome([1.0, 1.0], [1, 1])
    adv, _ = ADVANTAGE_ESTIMATORS.get("grpo")(AdvantageInputs(rewards, mask, torch.tensor([4, 4])))
    assert torch.all(adv == 0)


def test_rloo_baseline_excludes_the_sample_itself():
    rewards, mask = outcome([1.0, 0.0, 0.5], [1, 1, 1])
    adv, _ = ADVANTAGE_ESTIMATORS.get("rloo")(AdvantageInputs(rewards, mask, torch.tensor([0, 0, 0])))
    torch.testing.assert_close(adv[:, 1], torch.tensor([1 - 0.25, 0 - 0.75, 0.5 - 0.5]))


def test_reinforce_plus_plus_discounts_then_whitens_over_response_tokens():
    rewards, mask = outcome([1.0, 0.0], [2, 2])
    adv, returns = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(
        AdvantageInputs(rewards, mask, torch.tensor([0, 1])), gamma=0.5)
    torch.testing.assert_close(returns[0, 1:3], torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(returns[1], torch.zeros(4))
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-6 and abs(valid.std(unbiased=False).item() - 1) < 1e-4


def test_gae_uses_the_critic_values_and_skips_masked_steps():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 9.0, 0.25]])
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0]])  # a hole at t=2
    adv, returns = ADVANTAGE_ESTIMATORS.get("gae")(
        AdvantageInputs(rewards, mask, torch.tensor([0]), values), gamma=0.9, lam=0.5, whiten=False)
    # t=3: delta = 1 - 0.25 = 0.75; t=1 (next valid t'=3): delta = 0 + 0.9*0.25 - 0.5 = -0.275,
    # A = -0.275 + 0.9*0.5*0.75 = 0.0625
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0625, 0.0, 0.75]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.5625, 0.0, 1.0]]))


def test_gae_without_values_is_a_clear_error():
    rewards, mask = outcome([1.0], [1])
    with pytest.raises(ValueError, match="needs critic values"):
        ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(rewards, mask, torch.tensor([0])))


def test_unknown_estimator_suggests_the_closest_name():
    with pytest.raises(UsageError, match="did you mean 'grpo'"):
        ADVANTAGE_ESTIMATORS.get("grpp")
