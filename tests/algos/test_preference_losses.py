"""The preference and supervised losses against values worked out by hand (math module
only), one case per formula, with gradients where a sign matters."""
import math

import pytest
import torch

from mcore_rl.algos.preference import (DPO_LOSSES, PairLogps, bradley_terry_loss, implicit_rewards,
                                       kto_loss, kto_reference_point, sft_token_sum)


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def pair(chosen_tokens=2.0, rejected_tokens=4.0, requires_grad=False) -> PairLogps:
    """Policy chosen -1, rejected -3; reference -2 on both: log-ratios +1 and -1, h = 2."""
    t = lambda v: torch.tensor([v], dtype=torch.float64, requires_grad=requires_grad)
    return PairLogps(chosen=t(-1.0), rejected=t(-3.0), ref_chosen=t(-2.0), ref_rejected=t(-2.0),
                     chosen_tokens=torch.tensor([chosen_tokens]), rejected_tokens=torch.tensor([rejected_tokens]))


def test_dpo_sigmoid_is_minus_log_sigmoid_of_beta_times_the_log_ratio_gap():
    # beta * h = 0.5 * 2 = 1  ->  -log sigmoid(1) = log(1 + e^-1)
    got = DPO_LOSSES.get("sigmoid")(pair(), beta=0.5).item()
    assert got == pytest.approx(softplus(-1.0), abs=1e-12)
    assert got == pytest.approx(0.31326168751822286, abs=1e-12)


def test_conservative_dpo_mixes_in_the_flipped_label_by_the_smoothing():
    # 0.8 * log(1 + e^-1) + 0.2 * log(1 + e^1)
    got = DPO_LOSSES.get("sigmoid")(pair(), beta=0.5, label_smoothing=0.2).item()
    assert got == pytest.approx(0.8 * softplus(-1.0) + 0.2 * softplus(1.0), abs=1e-12)
    assert got == pytest.approx(0.5132616875182228, abs=1e-12)


def test_ipo_divides_each_log_ratio_by_its_completion_length():
    # h = 1/2 - (-1/4) = 0.75; 1/(2 beta) = 1 at beta 0.5  ->  (0.75 - 1)^2
    got = DPO_LOSSES.get("ipo")(pair(chosen_tokens=2, rejected_tokens=4), beta=0.5).item()
    assert got == pytest.approx(0.0625, abs=1e-12)
    # without the division it would be (2 - 1)^2 = 1
    assert DPO_LOSSES.get("ipo")(pair(chosen_tokens=1, rejected_tokens=1), beta=0.5).item() == pytest.approx(1.0)


def test_hinge_is_zero_beyond_the_margin_and_linear_inside_it():
    assert DPO_LOSSES.get("hinge")(pair(), beta=0.5).item() == 0.0          # 1 - 0.5 * 2
    assert DPO_LOSSES.get("hinge")(pair(), beta=0.25).item() == pytest.approx(0.5)  # 1 - 0.25 * 2


@pytest.mark.parametrize("name", ["sigmoid", "hinge", "ipo"])
def test_every_dpo_loss_raises_the_chosen_and_lowers_the_rejected_log_prob(name):
    x = pair(requires_grad=True)
    beta = 0.1 if name != "ipo" else 0.05   # inside the hinge margin; IPO below its target gap
    DPO_LOSSES.get(name)(x, beta=beta).sum().backward()
    assert x.chosen.grad.item() < 0 < x.rejected.grad.item()


def test_implicit_rewards_are_beta_times_the_log_ratios():
    chosen, rejected = implicit_rewards(pair(), beta=0.5)
    assert (chosen.item(), rejected.item()) == (0.5, -0.5)


def test_kto_reference_point_is_the_mean_log_ratio_clamped_at_zero():
    ref = torch.tensor([-1.5, -2.5, -2.0])
    assert kto_reference_point(torch.tensor([-1.0, -2.0, -3.0]), ref).item() == 0.0  # mean(0.5, 0.5, -1) = 0
    assert kto_reference_point(torch.tensor([-0.5, -0.5, -2.0]), ref).item() == pytest.approx(1.0)  # mean(1, 2, 0)
    assert kto_reference_point(torch.tensor([-2.0, -3.0, -3.0]), ref).item() == 0.0  # negative mean -> 0
    logps = torch.tensor([-0.5, -0.5, -2.0], requires_grad=True)
    assert not kto_reference_point(logps, ref).requires_grad


def test_kto_loss_weighs_desirable_and_undesirable_completions_against_the_reference_point():
    # r = +1 (desirable), -1 (undesirable); z0 = 0.5; beta = 2
    # desirable:   1.5 * (1 - sigmoid(2 * (1 - 0.5)))    = 1.5 * (1 - sigmoid(1))
    # undesirable: 0.5 * (1 - sigmoid(2 * (0.5 - (-1)))) = 0.5 * (1 - sigmoid(3))
    got = kto_loss(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]), torch.tensor([1, 0]),
                   reference_point=0.5, beta=2.0, desirable_weight=1.5, undesirable_weight=0.5)
    assert got.tolist() == pytest.approx([1.5 * (1 - sigmoid(1.0)), 0.5 * (1 - sigmoid(3.0))], abs=1e-7)
    assert got.tolist() == pytest.approx([0.40341213, 0.02371294], abs=1e-7)


def test_kto_gradient_pushes_desirable_up_and_undesirable_down():
    logps = torch.tensor([-1.0, -3.0], requires_grad=True)
    kto_loss(logps, torch.tensor([-2.0, -2.0]), torch.tensor([1, 0]), 0.5, beta=2.0).sum().backward()
    assert logps.grad[0] < 0 < logps.grad[1]


def test_bradley_terry_loss_with_and_without_a_margin():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx([softplus(-1.0), math.log(2)])
    # margin 1 on the first pair: -log sigmoid(2 - 1 - 1) = log 2
    assert bradley_terry_loss(chosen, rejected, torch.tensor([1.0, 0.0])).tolist() == pytest.approx(
        [math.log(2), math.log(2)])


def test_sft_token_sum_covers_completion_tokens_only():
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -4.0], [0.0, -8.0, -0.5, 0.0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    total, count = sft_token_sum(logprobs, mask)
    assert (total.item(), count.item()) == (14.5, 4.0)  # 2 + 4 + 8 + 0.5 over 4 tokens
