"""Policy/value losses, KL estimators and aggregation on hand-checked cases."""
import math

import pytest
import torch

from mcore_rl.algos import aggregate, kl_per_token
from mcore_rl.algos.kl import KLController
from mcore_rl.algos.losses import POLICY_LOSSES, clipped_value_loss, truncated_importance_weight


def test_ppo_clip_clips_the_ratio_on_the_side_that_would_overshoot():
    ppo = POLICY_LOSSES.get("ppo_clip")
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, diag = ppo(new, old, adv, clip_low=0.2, clip_high=0.2)
    # A>0, r=1.5 -> clipped to 1.2; A>0, r=0.5 -> min(0.5, 0.8)=0.5; A<0, r=1.5 -> 1.5;
    # A<0, r=0.5 -> clipped 0.8
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.5, 0.8]))
    assert diag["clip_fraction"].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    ppo = POLICY_LOSSES.get("ppo_clip")
    loss, _ = ppo(torch.log(torch.tensor([10.0])), torch.zeros(1), torch.tensor([-1.0]), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)


def test_ratio_one_gives_the_plain_policy_gradient():
    ppo = POLICY_LOSSES.get("ppo_clip")
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _ = ppo(lp, lp.detach(), adv)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -adv)


def test_aggregation_token_mean_and_seq_mean_differ_as_defined():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert [t.item() for t in aggregate(per_token, mask, "token_mean")] == [7.0, 4.0]
    assert [t.item() for t in aggregate(per_token, mask, "seq_mean")] == [5.0, 2.0]
    empty = aggregate(per_token, torch.zeros_like(mask), "seq_mean")
    assert [t.item() for t in empty] == [0.0, 0.0]


def test_kl_estimators_match_their_formulas():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_per_token(lp, ref, "k1"), torch.tensor([0.5, -1.0]))
    r = torch.exp(ref - lp)
    torch.testing.assert_close(kl_per_token(lp, ref, "k3"), r - 1 - torch.log(r))
    assert torch.all(kl_per_token(lp, ref, "k3") >= 0)


def test_adaptive_kl_coefficient_moves_towards_the_target():
    ctl = KLController(0.1, target=0.05, horizon=100)
    assert ctl.update(0.2, n_samples=10) > 0.1  # KL too high -> stronger penalty
    fixed = KLController(0.1)
    assert fixed.update(5.0, 10) == 0.1


def test_clipped_value_loss_takes_the_worse_of_clipped_and_unclipped():
    v, old, ret = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0])
    assert clipped_value_loss(v, old, ret, clip=0.5).item() == pytest.approx(0.5 * 4.0)
    v, ret = torch.tensor([2.0]), torch.tensor([3.0])
    assert clipped_value_loss(v, old, ret, clip=0.5).item() == pytest.approx(0.5 * 2.5 ** 2)


def test_truncated_importance_weight_is_capped():
    w = truncated_importance_weight(torch.tensor([0.0, 0.0]), torch.tensor([math.log(4.0), -5.0]), 2.0)
    torch.testing.assert_close(w, torch.tensor([0.25, 2.0]))


def test_mismatch_sums_on_hand_checked_tokens_only_where_the_mask_says_fresh():
    from mcore_rl.algos.losses import mismatch_metrics, mismatch_sums

    L = math.log
    # sequence 1: ratios 1.0, 1.2 (outside [0.9, 1.1]); sequence 2: 0.5 (outside), and a
    # stale token (mask 0) whose huge gap must not count
    trainer = torch.tensor([[0.0, L(1.2)], [L(0.5), 5.0]], dtype=torch.float64)
    engine = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    sums = {k: float(v) for k, v in mismatch_sums(trainer, engine, mask).items()}
    m = mismatch_metrics(sums)
    d = [0.0, L(1.2), L(2.0)]  # |log ratio|
    assert m["rollout/mismatch_tokens"] == 3
    assert m["rollout/token_mult_prob_error"] == pytest.approx((1.0 + 1.2 + 2.0) / 3)
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(sum(d) / 3)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(L(2.0))
    assert m["rollout/ratio_outside_band_frac"] == pytest.approx(2 / 3)
    assert m["rollout/seq_mult_prob_error_max"] == pytest.approx(2.0)  # sequence 2: exp(log 2)
    assert mismatch_metrics({"mismatch_tokens": 0.0}) == {}
