"""The update's charge for padding (`CostModel.micro_batch_tokens`, `padded_tokens`)."""
import random

import pytest
import torch

from mcore_rl.plan import simulate
from mcore_rl.plan.costs import CostModel, LengthDistribution, padded_tokens
from mcore_rl.train.micro_batches import pack_micro_batches


def test_padded_tokens_by_hand():
    # by length: [10, 10] (20 of 80; 30 x 3 > 80 ends it), then [30, 40] (40 x 2 = 80)
    assert padded_tokens([40, 10, 30, 10], budget=80) == 20 + 80
    assert padded_tokens([40, 10, 30, 10], budget=1000) == 4 * 40  # one micro-batch
    assert padded_tokens([50, 50, 50], budget=100) == 150  # equal lengths: no padding
    assert padded_tokens([300, 20], budget=100) == 20 + 300  # a long one alone


@pytest.mark.parametrize("seed", range(5))
def test_padded_tokens_are_what_the_trainers_micro_batches_hold(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 64))]
    budget = rng.choice([256, 1024, 4096])
    plan = pack_micro_batches(torch.tensor(lens), list(range(len(lens))), budget)
    assert padded_tokens(lens, budget) == sum(len(mb) * max(lens[i] for i in mb) for mb in plan)


def _costs(lengths: LengthDistribution, micro_batch_tokens: int) -> CostModel:
    return CostModel(decode_occupancy=(1, 64), decode_tokens_per_s=(10.0, 400.0),
                     prefill_tokens_per_s=1000.0, update_tokens_per_s=100.0, sync_s=0.1,
                     prompt_tokens=20, n_samples=4, prompts_per_step=2,
                     response_lengths=lengths, micro_batch_tokens=micro_batch_tokens)


def test_equal_lengths_cost_the_same_with_micro_batches():
    fixed = LengthDistribution("fixed", 40)
    plain = simulate(_costs(fixed, 0), "sync", steps=3)
    packed = simulate(_costs(fixed, 120), "sync", steps=3)  # two sequences per micro-batch
    assert packed.step_times_s == pytest.approx(plain.step_times_s)


def test_a_long_tail_makes_the_update_pay_for_padding():
    tail = LengthDistribution("longtail", 200, median=20, p90=150)
    plain = simulate(_costs(tail, 0), "sync", steps=3, seed=1)
    packed = simulate(_costs(tail, 400), "sync", steps=3, seed=1)

    def charged(result):  # tokens each update was charged for, at 100 tokens/s
        return [round((r.updated_at - r.turn_at) * 100.0) for r in result.step_records]

    tokens = [r.tokens for r in plain.step_records]
    assert [r.tokens for r in packed.step_records] == tokens  # the same samples
    assert charged(plain) == tokens
    assert all(c >= t for c, t in zip(charged(packed), tokens))
    assert sum(charged(packed)) > sum(tokens) + 50
