"""Off-policy corrections of the policy loss (``algorithm.off_policy_correction``) on
hand-checked cases: loss values and gradients with respect to the current log-probs.

Notation: pi = pi_theta (current weights, ``logprobs``), pi_prox (the weights the update
starts from, ``old_logprobs``), pi_behav (the weights that generated the sample, the
engine's ``rollout_logprobs``), A the advantage, C = ``is_cap``.
"""
import math

import pytest
import torch

from mcore_rl.algos.losses import (POLICY_LOSSES, decoupled_ppo, importance_weight_capped,
                                   tis_policy_gradient, truncated_importance_weight)
from mcore_rl.algos.objective import actor_loss_fn
from mcore_rl.config import AlgorithmConfig, load_config
from mcore_rl.config.ranges import check_ranges
from mcore_rl.data.batch import Batch
from mcore_rl.errors import ConfigError

L = math.log
ppo = POLICY_LOSSES.get("ppo_clip")

# decoupled_ppo, three tokens, clip 0.2, C = 2:
#   token  A    pi/pi_prox  pi_prox/pi_behav  ppo loss                 w     loss    d loss/d log pi
#   1      1    1.5         0.5               -min(1.5, 1.2)*1 = -1.2  0.5   -0.6    0 (clipped)
#   2      2    1.1         1.25              -2*1.1 = -2.2            1.25  -2.75   -A r w = -2*1.1*1.25 = -2.75
#   3     -1    1.0         4 -> capped 2     -(-1)*1 = 1              2     2.0     -A r w = 1*1*2 = 2
DPPO_ADV = [1.0, 2.0, -1.0]
DPPO_LOGPROBS = [L(1.5), L(1.1), 0.0]
DPPO_PROX = [0.0, 0.0, 0.0]
DPPO_BEHAV = [L(2.0), -L(1.25), -L(4.0)]
DPPO_LOSS = [-0.6, -2.75, 2.0]
DPPO_GRAD = [0.0, -2.75, 2.0]
DPPO_WEIGHT = [0.5, 1.25, 2.0]

# tis, three tokens, C = 2: loss = -A sg(min(pi/pi_behav, C)) log pi, grad = -A min(pi/pi_behav, C)
#   token  A     pi   pi_behav  ratio        w    loss                            grad
#   1      1     0.6  0.4       1.5          1.5  -1*1.5*log 0.6 = 0.766238       -1.5
#   2     -0.5   0.9  0.3       3 -> capped  2    0.5*2*log 0.9 = -0.105361       0.5*2 = 1.0
#   3      2     0.2  0.4       0.5          0.5  -2*0.5*log 0.2 = 1.609438       -2*0.5 = -1.0
TIS_ADV = [1.0, -0.5, 2.0]
TIS_LOGPROBS = [L(0.6), L(0.9), L(0.2)]
TIS_BEHAV = [L(0.4), L(0.3), L(0.4)]
TIS_LOSS = [0.766238, -0.105361, 1.609438]
TIS_GRAD = [-1.5, 1.0, -1.0]
TIS_WEIGHT = [1.5, 2.0, 0.5]


def t(values, grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def grad_of(loss, x):
    return torch.autograd.grad(loss.sum(), x)[0]


def test_decoupled_ppo_hand_checked_loss_weights_and_gradient():
    lp = t(DPPO_LOGPROBS, grad=True)
    per_token, diag = ppo(lp, t(DPPO_PROX), t(DPPO_ADV), clip_low=0.2, clip_high=0.2)
    loss, diag = decoupled_ppo(per_token, diag, t(DPPO_PROX), t(DPPO_BEHAV), cap=2.0)
    torch.testing.assert_close(loss, t(DPPO_LOSS))
    torch.testing.assert_close(diag["is_weight"], t(DPPO_WEIGHT))
    assert diag["is_capped"].tolist() == [0.0, 0.0, 1.0]
    assert diag["clip_fraction"].tolist() == [1.0, 0.0, 0.0]  # PPO's clip, against pi_prox
    torch.testing.assert_close(grad_of(loss, lp), t(DPPO_GRAD))
    assert not diag["is_weight"].requires_grad


def test_decoupled_ppo_with_proximal_equal_to_behaviour_is_plain_ppo_clip():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(16, generator=g, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    prox = lp.detach() + torch.randn(16, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(16, generator=g, dtype=torch.float64)
    plain, _ = ppo(lp, prox, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    per_token, diag = ppo(lp, prox, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    corrected, diag = decoupled_ppo(per_token, diag, prox, prox.clone(), cap=2.0)
    assert diag["is_weight"].tolist() == [1.0] * 16
    torch.testing.assert_close(corrected, plain)
    torch.testing.assert_close(grad_of(corrected, lp), grad_of(plain, lp))


def test_tis_hand_checked_loss_weights_and_gradient():
    lp = t(TIS_LOGPROBS, grad=True)
    loss, diag = tis_policy_gradient(lp, t(TIS_BEHAV), t(TIS_ADV), cap=2.0)
    torch.testing.assert_close(loss, t(TIS_LOSS), rtol=0, atol=1e-6)
    torch.testing.assert_close(diag["is_weight"], t(TIS_WEIGHT))
    assert diag["is_capped"].tolist() == [0.0, 1.0, 0.0]
    assert diag["clip_fraction"].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(grad_of(loss, lp), t(TIS_GRAD))


def test_tis_on_the_behaviour_policy_is_the_plain_policy_gradient():
    lp = t([-0.3, -1.7, -4.0], grad=True)
    adv = t([1.5, -2.0, 0.25])
    loss, diag = tis_policy_gradient(lp, lp.detach().clone(), adv, cap=2.0)
    assert diag["is_weight"].tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(grad_of(loss, lp), -adv)


def test_a_ratio_above_the_cap_gets_exactly_the_cap():
    lp, behav = t([L(10.0), L(2.5), L(1.5), 0.0]), t([0.0, 0.0, 0.0, 0.0])
    assert truncated_importance_weight(lp, behav, 2.5).tolist() == [2.5, 2.5, 1.5, 1.0]
    assert importance_weight_capped(lp, behav, 2.5).tolist()[::2] == [1.0, 0.0]
    # the capped token's gradient is -A * C, whatever its ratio
    x = t([L(10.0)], grad=True)
    loss, _ = tis_policy_gradient(x, t([0.0]), t([3.0]), cap=2.5)
    assert grad_of(loss, x).item() == pytest.approx(-3.0 * 2.5)


# Through the actor objective: one sequence of 4 positions, column 0 is the prompt (masked,
# filled with values that would change every number if they leaked in).

def _micro_batch(logprobs, prox, behav, adv, with_rollout=True):
    pad = [5.0]
    tensors = {"response_mask": torch.tensor([[0] + [1] * len(logprobs)]),
               "old_logprobs": t([pad + prox]), "advantages": t([pad + adv])}
    if with_rollout:
        tensors["rollout_logprobs"] = t([[-9.0] + behav])
    outputs = {"logprobs": t([[0.0] + logprobs], grad=True)}
    return outputs, Batch(tensors)


def _cfg(correction, **kw):
    return AlgorithmConfig(off_policy_correction=correction, is_cap=2.0, clip_ratio_low=0.2,
                           clip_ratio_high=0.2, **kw)


def test_actor_objective_decoupled_ppo():
    outputs, mb = _micro_batch(DPPO_LOGPROBS, DPPO_PROX, DPPO_BEHAV, DPPO_ADV)
    total, units, metrics = actor_loss_fn(_cfg("decoupled_ppo"), kl_coef=0.0)(outputs, mb)
    assert units.item() == 3
    assert total.item() == pytest.approx(sum(DPPO_LOSS))  # -0.6 - 2.75 + 2 = -1.35
    torch.testing.assert_close(grad_of(total, outputs["logprobs"]), t([[0.0] + DPPO_GRAD]))
    assert metrics["is_weight"].item() == pytest.approx(sum(DPPO_WEIGHT))  # summed; / units later
    assert metrics["is_capped_fraction"].item() == pytest.approx(1.0)
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)
    # |pi_prox - pi_behav| in log space: log 2 + log 1.25 + log 4
    assert metrics["engine_logprob_gap"].item() == pytest.approx(L(2.0) + L(1.25) + L(4.0))


def test_actor_objective_tis_replaces_the_policy_loss():
    prox = [L(0.5)] * 3  # only the ratio_abs_dev diagnostic reads pi_prox
    outputs, mb = _micro_batch(TIS_LOGPROBS, prox, TIS_BEHAV, TIS_ADV)
    total, units, metrics = actor_loss_fn(_cfg("tis"), kl_coef=0.0)(outputs, mb)
    assert units.item() == 3
    assert total.item() == pytest.approx(sum(TIS_LOSS), abs=1e-5)
    torch.testing.assert_close(grad_of(total, outputs["logprobs"]), t([[0.0] + TIS_GRAD]))
    assert metrics["is_weight"].item() == pytest.approx(sum(TIS_WEIGHT))
    assert metrics["is_capped_fraction"].item() == pytest.approx(1.0)
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)
    # pi / pi_prox = 1.2, 1.8, 0.4 -> |r - 1| = 0.2 + 0.8 + 0.6
    assert metrics["ratio_abs_dev"].item() == pytest.approx(1.6)


def test_actor_objective_none_is_plain_ppo_clip_and_ignores_the_behaviour_policy():
    outputs, mb = _micro_batch(DPPO_LOGPROBS, DPPO_PROX, DPPO_BEHAV, DPPO_ADV)
    total, units, metrics = actor_loss_fn(_cfg("none"), kl_coef=0.0)(outputs, mb)
    # ppo loss of the decoupled case without the weights: -1.2 - 2.2 + 1
    assert total.item() == pytest.approx(-2.4)
    # gradients -A r: 0 (clipped), -2*1.1, 1*1
    torch.testing.assert_close(grad_of(total, outputs["logprobs"]), t([[0.0, 0.0, -2.2, 1.0]]))
    assert "is_weight" not in metrics and "is_capped_fraction" not in metrics
    assert "engine_logprob_gap" in metrics
    outputs, mb = _micro_batch(DPPO_LOGPROBS, DPPO_PROX, DPPO_BEHAV, DPPO_ADV, with_rollout=False)
    total, _, _ = actor_loss_fn(_cfg("none"), kl_coef=0.0)(outputs, mb)
    assert total.item() == pytest.approx(-2.4)


# icepop and mis, four tokens, clip 0.2, band [0.5, 2], pi_prox = 1 (log 0); mis's weight
# w = pi_prox / pi_behav = r / (pi / pi_prox):
#   token  A    pi/pi_prox  r = pi/pi_behav  ppo loss  icepop          mis
#   1      1    1.1         1.5              -1.1      kept: -1.1      w = 1.5/1.1: -1.5
#   2      1    1.0         3.0              -1.0      masked (> 2)    masked (> 2)
#   3      1    0.9         0.4              -0.9      masked (< 0.5)  kept (only > 2 masks a token), w = 0.4/0.9: -0.4
#   4     -2    1.0         0.6               2.0      kept: 2.0       w = 0.6: 1.2
# gradients: icepop -A r on kept tokens (-1.1, 0, 0, 2); mis -A r w (-1.5, 0, -0.4, 1.2)
BAND_ADV = [1.0, 1.0, 1.0, -2.0]
BAND_LOGPROBS = [L(1.1), 0.0, L(0.9), 0.0]
BAND_PROX = [0.0] * 4
BAND_BEHAV = [L(1.1) - L(1.5), -L(3.0), L(0.9) - L(0.4), -L(0.6)]


def test_icepop_masks_tokens_outside_the_band_and_keeps_the_loss_of_the_others():
    outputs, mb = _micro_batch(BAND_LOGPROBS, BAND_PROX, BAND_BEHAV, BAND_ADV)
    total, units, metrics = actor_loss_fn(_cfg("icepop"), kl_coef=0.0)(outputs, mb)
    assert units.item() == 4  # masked tokens still count in the mean
    assert total.item() == pytest.approx(-1.1 + 2.0)
    torch.testing.assert_close(grad_of(total, outputs["logprobs"]), t([[0.0, -1.1, 0.0, 0.0, 2.0]]))
    assert metrics["is_masked_fraction"].item() == pytest.approx(2.0)  # summed; / units later
    assert "is_weight" not in metrics


def test_mis_at_token_level_masks_ratios_above_the_band_and_weights_the_others():
    outputs, mb = _micro_batch(BAND_LOGPROBS, BAND_PROX, BAND_BEHAV, BAND_ADV)
    total, units, metrics = actor_loss_fn(_cfg("mis"), kl_coef=0.0)(outputs, mb)
    assert units.item() == 4
    assert total.item() == pytest.approx(-1.5 - 0.4 + 1.2)
    torch.testing.assert_close(grad_of(total, outputs["logprobs"]),
                               t([[0.0, -1.5, 0.0, -0.4, 1.2]]))
    assert metrics["is_masked_fraction"].item() == pytest.approx(1.0)
    assert metrics["is_weight"].item() == pytest.approx(1.5 / 1.1 + 0.4 / 0.9 + 0.6)


def test_mis_at_sequence_level_masks_whole_sequences_by_their_geometric_mean_ratio():
    # sequence 1: r = 1.5, 3 -> sqrt(4.5) = 2.12 > 2: masked whole;
    # sequence 2: r = 0.4, 0.9 -> sqrt(0.36) = 0.6 in [0.5, 2]: kept, w = 0.4/0.9 and 0.9:
    #   losses -0.9 * 0.4/0.9 = -0.4 and 2 * 0.9 = 1.8; gradients -A r w: -0.4, 1.8
    behav = [L(1.1) - L(1.5), -L(3.0), L(0.9) - L(0.4), -L(0.9)]
    tensors = {"response_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]),
               "old_logprobs": t([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]]),
               "advantages": t([[5.0, 1.0, 1.0], [5.0, 1.0, -2.0]]),
               "rollout_logprobs": t([[-9.0] + behav[:2], [-9.0] + behav[2:]])}
    outputs = {"logprobs": t([[0.0, L(1.1), 0.0], [0.0, L(0.9), 0.0]], grad=True)}
    cfg = _cfg("mis", mis_level="sequence")
    total, units, metrics = actor_loss_fn(cfg, kl_coef=0.0)(outputs, Batch(tensors))
    assert total.item() == pytest.approx(-0.4 + 1.8)
    torch.testing.assert_close(grad_of(total, outputs["logprobs"]),
                               t([[0.0, 0.0, 0.0], [0.0, -0.4, 1.8]]))
    assert metrics["is_masked_fraction"].item() == pytest.approx(2.0)


def test_the_masking_band_must_be_ordered():
    with pytest.raises(ConfigError, match=r"algorithm.is_mask_low \(3\) must be below "
                                          r"algorithm.is_mask_high \(2\)"):
        check_ranges(load_config(None, ["algorithm.is_mask_low=3"]))


@pytest.mark.parametrize("correction", ["decoupled_ppo", "tis", "icepop", "mis"])
def test_a_correction_without_rollout_logprobs_is_refused(correction):
    outputs, mb = _micro_batch(DPPO_LOGPROBS, DPPO_PROX, DPPO_BEHAV, DPPO_ADV, with_rollout=False)
    with pytest.raises(ValueError, match=rf"off_policy_correction={correction}.*'rollout_logprobs'"):
        actor_loss_fn(_cfg(correction), kl_coef=0.0)(outputs, mb)


def test_config_refuses_unknown_corrections_and_non_positive_caps():
    assert load_config(None, ["algorithm.off_policy_correction=tis"]).algorithm.off_policy_correction == "tis"
    with pytest.raises(ConfigError, match=r"algorithm.off_policy_correction.*one of"):
        load_config(None, ["algorithm.off_policy_correction=truncated"])
    with pytest.raises(ConfigError, match=r"algorithm.is_cap must be > 0, got 0; set algorithm.is_cap"):
        check_ranges(load_config(None, ["algorithm.is_cap=0"]))
