"""Top-p / top-k sampling end to end: the trainer's log-probs describe the truncated
distribution the engine sampled from (`mcore_rl.kernels.token_logprobs` with ``top_k`` /
``top_p``), so trainer and engine agree on every sampled token; without the
renormalisation every ratio is off by the kept mass, which the mismatch metrics show."""
import pytest

from tests.rl.golden.runs import BASE, play_overrides

SAMPLING = ["rollout.top_p=0.8", "rollout.top_k=5", "train.steps=2", "train.val_every=0", "train.warm_start_steps=0",
            "reshard.verify=false"]
# PPO epochs: the old log-probs come from a forward of their own (their kept flags too); a KL
# loss against the reference adds the reference's truncated log-probs
PPO_KL = ["algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "algorithm.kl_coef=0.05"]


@pytest.fixture(scope="module")
def renormalised(tmp_path_factory):
    return play_overrides(2, BASE + SAMPLING + PPO_KL + ["parallel.tp=2"],
                          str(tmp_path_factory.mktemp("renormalised")))


def test_trainer_and_engine_agree_on_the_truncated_distribution_at_tp2(renormalised):
    steps = [h for h in renormalised if "rollout/token_mult_prob_error" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["rollout/mismatch_tokens"] > 100
        assert 1.0 <= h["rollout/token_mult_prob_error"] < 1.0001, h
        assert h["rollout/outside_kept_set"] < 0.01, h
        assert h["actor/kl_loss"] >= 0


def test_without_the_renormalisation_the_ratio_is_off_by_the_kept_mass(tmp_path):
    history = play_overrides(1, BASE + SAMPLING + ["rollout.renormalize_truncated=false"], str(tmp_path))
    steps = [h for h in history if "rollout/token_mult_prob_error" in h]
    assert len(steps) == 2
    for h in steps:
        # exp|log p - log p~| = 1 / kept mass > 1 on every token the truncation cut anything from
        assert h["rollout/token_mult_prob_error"] > 1.01, h
        assert "rollout/outside_kept_set" not in h


def test_replaying_the_engines_sampling_masks_agrees_as_well(tmp_path):
    history = play_overrides(1, BASE + SAMPLING + ["rollout.engine=hf_batched", "rollout.replay_sampling_mask=true"],
                             str(tmp_path))
    steps = [h for h in history if "rollout/token_mult_prob_error" in h]
    assert len(steps) == 2
    for h in steps:
        assert 1.0 <= h["rollout/token_mult_prob_error"] < 1.0001, h
        assert h["rollout/outside_kept_set"] == 0, h  # the sampled token is in its own mask
