"""Dynamic sampling: only groups whose scores differ reach a step; rounds are capped."""
import json
from pathlib import Path

import pytest
import torch

from mcore_rl.config import load_config, validate_config
from mcore_rl.data.batch import Batch
from mcore_rl.rl.dynamic_sampling import InformativeGroups, informative_groups
from tests.rl.golden.runs import BASE, REPO
from tests.world import shared_world


def scored(groups: list[list[float]], tag: str = "") -> Batch:
    """One row per score, group by group; ``meta["who"]`` names each row (tag, group, row)."""
    scores = [s for g in groups for s in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    who = [f"{tag}{i}.{j}" for i, g in enumerate(groups) for j in range(len(g))]
    b = Batch.from_sequences([[1, 2, 3]] * len(scores), [1] * len(scores), who=who)
    return b.with_tensors(group_id=torch.tensor(ids), scores=torch.tensor(scores))


def groups_of(batch: Batch) -> list[list[str]]:
    """The rows' names per group id, in id order (checks the renumbering 0.. too)."""
    ids = batch["group_id"].tolist()
    assert sorted(set(ids)) == list(range(len(set(ids))))
    return [[w for w, g in zip(batch.meta["who"], ids) if g == k] for k in range(len(set(ids)))]


def test_informative_means_the_group_scores_differ():
    b = scored([[1, 1, 1], [0, 1, 0], [0, 0], [0.5, 0.5000001]])
    assert informative_groups(b).tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2


def test_a_step_waits_for_enough_informative_groups_and_takes_them_in_order():
    pool = InformativeGroups(groups_per_step=2, max_extra_rounds=3, keep_surplus=False)
    step, m = pool.offer(scored([[1, 1], [0, 1], [0, 0]], "a"))
    assert step is None and m == {}
    step, m = pool.offer(scored([[1, 0], [1, 1], [0, 1]], "b"))
    assert groups_of(step) == [["a1.0", "a1.1"], ["b0.0", "b0.1"]]
    assert m["rollout/dynamic_rounds"] == 2.0
    assert m["rollout/dynamic_filtered_frac"] == pytest.approx(3 / 6)
    assert m["rollout/dynamic_score_mean"] == pytest.approx(7 / 12)
    assert m["rollout/dynamic_short_groups"] == 0.0
    # b2 was surplus: one version old after this step's update, so it is discarded and counted
    step, m = pool.offer(scored([[0, 1], [1, 0]], "c"))
    assert groups_of(step) == [["c0.0", "c0.1"], ["c1.0", "c1.1"]]
    assert m["rollout/dynamic_discarded_groups"] == 1.0 and m["rollout/dynamic_rounds"] == 1.0


def test_surplus_carries_over_when_staleness_allows_it():
    pool = InformativeGroups(groups_per_step=2, max_extra_rounds=0, keep_surplus=True)
    step, _ = pool.offer(scored([[0, 1], [1, 0], [0, 2]], "a"))
    assert groups_of(step) == [["a0.0", "a0.1"], ["a1.0", "a1.1"]]
    step, m = pool.offer(scored([[1, 1], [3, 4]], "b"))
    assert groups_of(step) == [["a2.0", "a2.1"], ["b1.0", "b1.1"]]
    assert m["rollout/dynamic_discarded_groups"] == 0.0


def test_at_the_round_limit_the_step_trains_on_what_it_has_and_says_how_short():
    pool = InformativeGroups(groups_per_step=3, max_extra_rounds=1, keep_surplus=False)
    assert pool.offer(scored([[1, 1], [0, 1]], "a"))[0] is None
    step, m = pool.offer(scored([[0, 0], [1, 1]], "b"))
    assert groups_of(step) == [["a1.0", "a1.1"]]
    assert m["rollout/dynamic_short_groups"] == 2.0 and m["rollout/dynamic_rounds"] == 2.0
    # nothing informative in any round: the last round as it is, all of it short
    step, m = pool.offer(scored([[1, 1], [0, 0]], "c"))
    assert step is None
    step, m = pool.offer(scored([[2, 2], [3, 3]], "d"))
    assert groups_of(step) == [["d0.0", "d0.1"], ["d1.0", "d1.1"]]
    assert m["rollout/dynamic_short_groups"] == 3.0 and m["rollout/dynamic_filtered_frac"] == 1.0


def test_groups_of_different_rounds_never_merge_even_with_equal_ids():
    pool = InformativeGroups(groups_per_step=4, max_extra_rounds=3, keep_surplus=False)
    for tag in "abcd":
        step, _ = pool.offer(scored([[0, 1]], tag))
    assert groups_of(step) == [[f"{t}0.0", f"{t}0.1"] for t in "abcd"]


def test_a_pool_saved_between_rounds_goes_on_as_the_uninterrupted_one(tmp_path):
    def pool():
        return InformativeGroups(groups_per_step=3, max_extra_rounds=1, keep_surplus=True)

    whole = pool()
    whole.offer(scored([[1, 1], [0, 1]], "a"))
    expected = whole.offer(scored([[0, 0], [2, 3]], "b"))
    saved = pool()
    saved.offer(scored([[1, 1], [0, 1]], "a"))
    torch.save(saved.state_dict(), tmp_path / "pool.pt")  # as a checkpoint keeps it
    resumed = pool()
    resumed.load_state_dict(torch.load(tmp_path / "pool.pt", weights_only=True))
    step, metrics = resumed.offer(scored([[0, 0], [2, 3]], "b"))
    assert step is not None and metrics == expected[1]  # the round limit counted the first round
    assert groups_of(step) == groups_of(expected[0]) == [["a1.0", "a1.1"], ["b1.0", "b1.1"]]


@pytest.mark.parametrize("kw", [dict(groups_per_step=0, max_extra_rounds=1),
                                dict(groups_per_step=1, max_extra_rounds=-1)])
def test_bad_sizes_are_refused(kw):
    with pytest.raises(ValueError, match="must be"):
        InformativeGroups(keep_surplus=False, **kw)


# --- on real runs: the quick-start task with a reward that makes many groups all-correct ---

def even_sums_free(prompt: str, response: str, meta: dict) -> float:
    """Exact match, but every answer to a prompt whose sum is even scores 1: those groups
    are all-correct and carry no GRPO signal."""
    return 1.0 if int(meta["answer"]) % 2 == 0 or response.strip() == str(meta["answer"]) else 0.0


DYNAMIC = ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=3",
           "reward.name=tests.rl.test_dynamic_sampling:even_sums_free", "train.steps=3",
           "train.val_every=0", "data.prompts_per_step=8"]


def _loop_batches(rank, world_size, overrides):
    """Run the job fused into this world's ranks, recording each trained batch's groups'
    scores."""
    from mcore_rl import trainer
    from mcore_rl.config import load_config, validate_config
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world

    trained = []
    learn = trainer.learn

    def recording(state, batch, timer):
        groups: dict[int, list[float]] = {}
        for g, s in zip(batch["group_id"].tolist(), batch["scores"].tolist()):
            groups.setdefault(g, []).append(s)
        trained.append(list(groups.values()))
        return learn(state, batch, timer)

    trainer.learn = recording
    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
    try:
        run_in_this_world(cfg)
    finally:
        trainer.learn = learn
        destroy_parallel()
    history = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl").read_text().splitlines()]
    return trained, [h for h in history if h.get("step", 0) > 0]


def test_the_fused_placement_trains_only_on_informative_groups(tmp_path):
    trained, steps = shared_world(1).run(_loop_batches, BASE + DYNAMIC + [f"logging.dir={tmp_path}"])[0]
    assert len(trained) == len(steps) == 3
    for groups, m in zip(trained, steps):
        assert all(max(g) > min(g) for g in groups), groups  # no all-equal group was trained
        assert len(groups) == 8 - m["rollout/dynamic_short_groups"]
        assert m["rollout/dynamic_rounds"] >= 2  # about half of each round is filtered
        assert 0.4 <= m["rollout/dynamic_filtered_frac"] < 1


def test_the_graph_fills_its_steps_and_stops_its_feed_at_the_last_one(tmp_path):
    from mcore_rl.roles.graph import run_job

    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml",
                                      BASE + DYNAMIC + [f"logging.dir={tmp_path}"]), 1)
    stats = run_job(cfg)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if h.get("step", 0) > 0]
    assert [h["step"] for h in steps] == [1, 2, 3]
    rounds = sum(h["rollout/dynamic_rounds"] for h in steps)
    assert stats.roles["trainer"].calls == rounds > 3  # each round reached the trainer once
    # the feed held 3 * 4 rounds; the launch stopped after the last step (one round in flight)
    assert stats.roles["rollout"].calls <= rounds + 1 < 12
    assert all(h["rollout/dynamic_short_groups"] == 0 for h in steps), steps


class StopAfter:
    """A stop request at the end of step ``n`` (the trainer asks once per step)."""

    def __init__(self, n: int):
        self.n, self.asked = n, 0

    def should_stop(self, ctx) -> bool:
        self.asked += 1
        return self.asked >= self.n

    def acknowledge(self, ctx, step) -> None:
        pass


def _scores_per_step(rank, world_size, overrides, stop_after=None):
    """The fused run's step metrics that depend on what was sampled, by step; with
    ``stop_after``: stopped (and checkpointed) at the end of that step."""
    from mcore_rl.config import load_config, validate_config
    from mcore_rl.errors import StopRequested
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world

    cfg = validate_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
    try:
        run_in_this_world(cfg, StopAfter(stop_after) if stop_after else None)
    except StopRequested:
        pass
    finally:
        destroy_parallel()
    history = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl").read_text().splitlines()]
    keys = ("reward/mean", "rollout/dynamic_rounds", "rollout/dynamic_filtered_frac")
    return {h["step"]: tuple(h[k] for k in keys) for h in history if "rollout/dynamic_rounds" in h}


def test_a_resumed_run_samples_and_trains_what_the_uninterrupted_run_did(tmp_path):
    """A step may take several rounds of prompts; the rounds after a resume are numbered
    (and seeded) on from all the rounds taken before, not from the step count. With
    ``train.max_staleness=1`` the pool keeps a step's surplus groups for the next step, and
    the checkpoint keeps the pool: the resumed run trains those groups too."""
    from mcore_rl.train.run_checkpoints import RunCheckpoints
    from mcore_rl.trainer import DYNAMIC_POOL

    run = BASE + DYNAMIC + ["data.prompts_per_step=7", "train.max_staleness=1",
                            "checkpoint.save_every=0", "checkpoint.resume=auto"]
    world = shared_world(1)
    whole = world.run(_scores_per_step, run + [f"logging.dir={tmp_path}/whole"])[0]
    split = tmp_path / "split"
    first = world.run(_scores_per_step, run + [f"logging.dir={split}"], 1)[0]
    assert list(first) == [1] and first[1][1] >= 2  # the first step took more than one round
    kept = RunCheckpoints.load_object(split / "checkpoints" / "step_000001", DYNAMIC_POOL)
    assert kept["pool"] is not None  # surplus groups wait for step 2
    resumed = world.run(_scores_per_step, run + [f"logging.dir={split}"])[0]
    assert resumed == whole, (resumed, whole)
