"""The staleness bound at consumption: whole prompt groups older than K versions go."""
import pytest
import torch

from mcore_rl.data.batch import Batch
from mcore_rl.rl.staleness import within_staleness


def batch(versions: list[int], groups: list[int]) -> Batch:
    b = Batch.from_sequences([[1, 2, 3]] * len(versions), [1] * len(versions),
                             weight_version=versions)
    return b.with_tensors(group_id=torch.tensor(groups))


def test_fresh_samples_pass_untouched_with_their_staleness_reported():
    b = batch([4, 4, 3, 3], [0, 0, 1, 1])
    kept, m = within_staleness(b, current_version=4, max_staleness=1)
    assert kept is b
    assert m == {"rollout/staleness_max": 1.0, "rollout/staleness_mean": 0.5,
                 "rollout/stale_dropped": 0.0, "rollout/stale_dropped_groups": 0.0}


def test_a_group_with_any_sample_over_the_bound_is_dropped_whole():
    b = batch([5, 5, 3, 5, 5, 5], [0, 0, 1, 1, 2, 2])
    kept, m = within_staleness(b, current_version=5, max_staleness=1)
    assert kept["group_id"].tolist() == [0, 0, 2, 2]
    assert kept.meta["weight_version"] == [5, 5, 5, 5]
    assert (m["rollout/stale_dropped"], m["rollout/stale_dropped_groups"]) == (2.0, 1.0)
    assert m["rollout/staleness_max"] == 0.0  # of what is trained on: the kept groups


@pytest.mark.parametrize("k, left", [(0, None), (2, 4)])
def test_the_bound_is_inclusive_and_nothing_left_is_none(k, left):
    kept, m = within_staleness(batch([3, 3, 3, 3], [0, 0, 1, 1]), current_version=5, max_staleness=k)
    assert (kept is None) if left is None else len(kept) == left


def _state(steps: int, max_staleness: int):
    from types import SimpleNamespace

    from mcore_rl.config import load_config
    from mcore_rl.rl.setup import RunState

    cfg = load_config("configs/quickstart.yaml", [f"train.steps={steps}",
                                                  f"train.max_staleness={max_staleness}"])
    state = RunState.__new__(RunState)
    state.__dict__.update(cfg=cfg, step=0, weight_version=3, dynamic=None, stale_dropped=0.0,
                          stale_dropped_groups=0.0, stale_batches=0,
                          prompts=SimpleNamespace(position=0))
    return state


def test_a_batch_with_nothing_fresh_makes_no_step_and_the_shortfall_is_explained():
    from mcore_rl.trainer import short_of_steps, train_step

    state = _state(steps=2, max_staleness=1)
    old = batch([1, 1, 0, 0], [0, 0, 1, 1]).with_tensors(scores=torch.ones(4))
    old.meta["finish_reason"] = ["stop"] * 4
    assert train_step(state, old) is None
    assert (state.step, state.stale_batches, state.stale_dropped_groups) == (0, 1, 2.0)
    state.step = 1  # the feed's other batch made a step, and the feed ended
    line = short_of_steps(state)
    assert line.startswith("mcore-rl: the run ended at step 1 of 2: 1 batch(es) held only "
                           "prompt groups over train.max_staleness=1"), line
    state.dynamic = object()  # dynamic sampling's feed holds spare rounds: no such count
    assert short_of_steps(state) is None
    state.dynamic, state.step = None, 0  # a run that ended otherwise (a failure): not so
    assert short_of_steps(state) is None
