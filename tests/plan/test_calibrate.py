"""The planner's calibration (`mcore_rl.plan.calibrate`) on hand-checked numbers, and the
colocated placement of the simulator against step times worked out by hand."""
from __future__ import annotations

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.plan import CostModel, LengthDistribution, simulate
from mcore_rl.plan.calibrate import (calibrated_costs, fit_update, predicted_tokens_per_s,
                                     trainer_costs)


def test_fit_update_recovers_a_fixed_part_and_a_rate():
    points = [(1000, 0.5 + 1000 / 400), (1000, 0.5 + 1000 / 400), (3000, 0.5 + 3000 / 400)]
    overhead, rate = fit_update(points)
    assert overhead == pytest.approx(0.5) and rate == pytest.approx(400)


def test_fit_update_floors_a_negative_fixed_part_at_zero():
    overhead, rate = fit_update([(1000, 1.0), (2000, 2.5)])  # the line crosses 0 at -0.5 s
    assert overhead == 0.0
    assert rate == pytest.approx(1 / ((1000 * 1.0 + 2000 * 2.5) / (1000 ** 2 + 2000 ** 2)))


@pytest.mark.parametrize("points, message", [
    ([(1000, 1.0), (1000, 1.2)], "at least two different token counts"),
    ([(1000, 2.0), (2000, 1.0)], "took no longer with more tokens"),
])
def test_fit_update_refuses_what_cannot_give_a_rate(points, message):
    with pytest.raises(UsageError, match=message):
        fit_update(points)


def _step(tokens: int, turn: float, generate=2.0, score=0.4, sync=0.3, rest=0.25) -> dict:
    # the turn split over the phases `run_ours` reports
    return {"tokens": tokens, "engine_sleep": 0.1 * turn, "logprobs": 0.3 * turn,
            "values": 0.0, "update": 0.6 * turn, "generate": generate, "score": score,
            "sync": sync, "step": generate + score + turn + sync + rest}


def test_trainer_costs_from_the_phase_timers_of_fixed_length_runs():
    steps = [_step(800, 0.2 + 800 / 1000), _step(800, 0.2 + 800 / 1000),
             _step(2400, 0.2 + 2400 / 1000, sync=0.5)]
    costs = trainer_costs(steps, prompts_per_step=4)
    assert costs.update_overhead_s == pytest.approx(0.2)
    assert costs.update_tokens_per_s == pytest.approx(1000)
    assert costs.sync_s == pytest.approx(0.3)  # the median
    assert costs.reward_s_per_group == pytest.approx(0.1)
    assert costs.step_overhead_s == pytest.approx(0.25)


ENGINE = {"decode": {"occupancy": [1, 8], "tokens_per_s": [20.0, 160.0],
                     "prefill_tokens_per_s": 1e9},
          "static": {"lengths": [3, 100, 250, 40]}, "prompt_tokens_mean": 0.4}


def test_calibrated_costs_truncate_the_natural_lengths_at_the_cap():
    trainer = trainer_costs([_step(800, 1.0), _step(1600, 1.8)], prompts_per_step=2)
    costs = calibrated_costs(ENGINE, trainer, cap=64, prompts_per_step=2, n_samples=4)
    assert costs.response_lengths.lengths == (3, 64, 64, 40)
    assert costs.response_lengths.max_new_tokens == 64
    assert costs.decode_step_s(8) == pytest.approx(8 / 160)
    assert (costs.prompt_tokens, costs.n_samples, costs.prompts_per_step) == (0, 4, 2)


def _fixed(**changes) -> CostModel:
    """8 sequences of 100 tokens a step: 5 s of generation at 160 tokens/s; a 0.8 s update
    (800 tokens at 1000/s) and a 1 s sync."""
    return CostModel(**{**dict(
        decode_occupancy=(1, 8, 32), decode_tokens_per_s=(20.0, 160.0, 320.0),
        prefill_tokens_per_s=1e9, update_tokens_per_s=1000.0, sync_s=1.0, prompt_tokens=0,
        n_samples=4, prompts_per_step=2, response_lengths=LengthDistribution("fixed", 100)),
        **changes})


@pytest.mark.parametrize("placement, step_s", [
    # beside the trainer, the next batch is generated during the update; it waits for the
    # sync (a generate call cannot take weights mid-way): generation + sync
    ("separate", 5.0 + 1.0),
    # taking turns, the trainer's turn waits for the next batch's generation (it holds the
    # engine): generation + update + sync, no overlap
    ("colocated", 5.0 + 0.8 + 1.0),
])
def test_one_step_off_step_time_by_placement(placement, step_s):
    result = simulate(_fixed(), "one_step_off", steps=8, placement=placement)
    assert result.step_time_s == pytest.approx(step_s)


def test_the_steps_fixed_part_is_trainer_time_the_engines_run_through():
    # colocated async with a long step overhead: generation proceeds during it, so most of
    # it is hidden; synchronous, the step grows by all of it
    base, slow = _fixed(), _fixed(step_overhead_s=2.0)
    sync = [simulate(c, "sync", steps=8, placement="colocated").step_time_s for c in (base, slow)]
    assert sync[1] - sync[0] == pytest.approx(2.0)
    run = [simulate(c, "async", k=2, steps=12, placement="colocated").step_time_s for c in (base, slow)]
    assert run[1] - run[0] < 0.5 * 2.0


def test_predicted_tokens_per_s_of_a_synchronous_run_is_tokens_over_the_step():
    costs = _fixed(step_overhead_s=0.2)
    step_s = 5.0 + 0.8 + 1.0 + 0.2
    assert predicted_tokens_per_s(costs, "sync", 0, steps=5, warmup=1) == pytest.approx(800 / step_s)
    for steps, warmup in ((3, 2), (5, 0)):  # nothing measured; step 1 has no interval
        with pytest.raises(UsageError, match="keep warmup >= 1"):
            predicted_tokens_per_s(costs, "sync", 0, steps=steps, warmup=warmup)
