"""The planner's simulator (`mcore_rl.plan`) against the staleness contract, under adversarial
delays drawn by hypothesis: response lengths with very long tails, slow rewards and updates,
replicas slowed down (one of them very much), every schedule, K in 0..3, 1 to 3 replicas,
``on_stale`` drop / regenerate, ``partial`` continue / abort, engines beside the trainer or
taking turns with it (``placement``).

Properties (each read off the per-group and per-step records, `SimResult.groups` and
`SimResult.step_records`):

- no trained token is more than K weight versions older than the weights it updates;
- the feed never lets more than (K+1)*P groups be unfinished;
- every admitted group is trained exactly once or dropped exactly once, never both, and
  no group is in two steps;
- K = 0 is ``sync``: the same groups in the same steps, in the same order;
- ``on_stale: regenerate`` regenerates exactly when, and only what, ``drop`` lets leave a
  replica over the bound (the two runs are the same until then); it drops only groups that
  aged past K in the queues after leaving their replica; the static schedules drop and
  regenerate nothing;
- colocated, no engine steps while the trainer updates.

Hypothesis is steered (``target``) towards runs whose groups age past K, where the contract
has work to do.

Then hand-checked numbers (`CostModel.decode_step_s`, a synchronous run's step time) and
bad input (one-line `UsageError`).
"""
from __future__ import annotations

import bisect
import json

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from mcore_rl.errors import UsageError
from mcore_rl.plan import CostModel, Delays, LengthDistribution, SimResult, simulate

EXAMPLES = settings(deadline=None, max_examples=300, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""Sized for the whole file to run in seconds (at 600 one test spent minutes in hypothesis's
own generation, not in the simulator); the same examples on every run (a CI run is
reproducible; widen the search by hand with a random seed)."""

BASE = dict(decode_occupancy=(1, 4, 16), decode_tokens_per_s=(50.0, 160.0, 400.0),
            prefill_tokens_per_s=4000.0, update_tokens_per_s=2000.0, sync_s=0.3,
            update_overhead_s=0.1, reward_s_per_group=0.01, prompt_tokens=16,
            response_lengths=LengthDistribution("longtail", 2000, median=20, p90=300))


# ----- strategies ---------------------------------------------------------------------------
@st.composite
def costs(draw) -> CostModel:
    """A small workload: P in 1..4 groups of 1..3 samples, replicas of small capacity."""
    p, n = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    return CostModel(**{**BASE, "n_samples": n, "prompts_per_step": p,
                        "max_seqs_per_replica": draw(st.integers(n, 3 * n * p)),
                        "sync_s": draw(st.sampled_from([0.0, 0.3, 5.0])),
                        "step_overhead_s": draw(st.sampled_from([0.0, 0.2])),
                        "prompt_tokens": draw(st.sampled_from([0, 16, 500]))})


def slowdowns():
    """Per-replica factors; often one replica very slow."""
    usual = st.lists(st.sampled_from([0.5, 1.0, 1.0, 1.5, 3.0]), min_size=1, max_size=3)
    very_slow = st.tuples(st.integers(0, 2), st.sampled_from([30.0, 300.0]))

    def with_slow(pair):
        factors, (which, factor) = pair
        factors = list(factors) + [1.0] * (3 - len(factors))
        factors[which] = factor
        return tuple(factors)

    return st.one_of(st.just(()), usual.map(tuple), st.tuples(usual, very_slow).map(with_slow))


LENGTHS = st.sampled_from([1, 2, 5, 20, 60, 400, 1500, 4000])
"""Response lengths, short to very long (the cap of ``BASE``'s distribution is 2000)."""

delays = st.builds(
    Delays,
    response_lengths=st.one_of(  # () : drawn from the long-tailed distribution
        st.just(()), st.lists(LENGTHS, min_size=1, max_size=16).map(tuple)),
    reward_s=st.lists(st.sampled_from([0.0, 0.01, 0.5, 20.0]), max_size=5).map(tuple),
    update_extra_s=st.lists(st.sampled_from([0.0, 1.0, 30.0]), max_size=3).map(tuple),
    replica_slowdown=slowdowns())

runs = st.fixed_dictionaries({
    "schedule": st.sampled_from(["async", "sync", "one_step_off", "async"]),
    "k": st.sampled_from([0, 1, 1, 2, 3]), "replicas": st.integers(1, 3),
    "on_stale": st.sampled_from(["drop", "regenerate"]),
    "partial": st.sampled_from(["continue", "abort"]), "steps": st.integers(1, 8),
    "placement": st.sampled_from(["separate", "colocated"]),
    "seed": st.integers(0, 2 ** 16)})


def expected_lengths(c: CostModel, d: Delays, gid: int) -> int | None:
    """Response tokens of group ``gid`` when the delays fix them (None: drawn)."""
    if not d.response_lengths:
        return None
    n = c.n_samples
    return sum(d.response_lengths[(gid * n + j) % len(d.response_lengths)] for j in range(n))


def over_at_engine(result: SimResult) -> int:
    """How far past K the stalest group was when it left its replica."""
    return max(g.emitted_version - g.oldest_version for g in result.groups) - result.k


def simulated(c: CostModel, d: Delays, run: dict) -> SimResult:
    """`simulate`, steering hypothesis towards runs whose groups age past K (at the engine,
    and by the time the trainer takes them): where the contract has work to do."""
    result = simulate(c, delays=d, **run)
    target(float(over_at_engine(result)), label="staleness past K at the engine")
    target(float(max(g.staleness for g in result.groups) - result.k),
           label="staleness past K at the trainer")
    return result


# ----- properties ---------------------------------------------------------------------------
@EXAMPLES
@given(costs(), delays, runs)
def test_no_trained_token_is_more_than_k_versions_old(c, d, run):
    result = simulated(c, d, run)
    k = result.k
    trained = [g for g in result.groups if not g.dropped]
    assert trained, "the first step always trains"
    for g in trained:
        staleness = [s for s, _ in g.token_staleness]
        assert max(staleness) <= k, (g.gid, g.token_staleness, k)
        assert min(staleness) >= 0
        assert g.staleness <= k
        want = expected_lengths(c, d, g.gid)
        if want is not None:  # every response token is accounted for, with its version
            assert sum(count for _, count in g.token_versions) == want
    assert result.token_staleness_max <= k and result.staleness_max <= k
    # and each version is one the replica could hold: no older than the weights every
    # replica had when the group came in, no newer than those updated before it left
    ended = sorted(s.ended_at for s in result.step_records)
    updated = sorted(s.updated_at for s in result.step_records)
    for g in result.groups:
        low = 1 + bisect.bisect_right(ended, g.admitted_at)
        high = 1 + bisect.bisect_right(updated, g.emitted_at)
        assert all(low <= v <= high for v, _ in g.token_versions), (g, low, high)


@EXAMPLES
@given(costs(), delays, runs)
def test_the_feed_keeps_at_most_k_plus_one_steps_of_groups_unfinished(c, d, run):
    result = simulated(c, d, run)
    window = (result.k + 1) * c.prompts_per_step
    finished = sorted(g.finished_at for g in result.groups)
    for g in result.groups:
        # when group gid came in, groups 0..gid were admitted: at most `window` unfinished
        done_by_then = bisect.bisect_right(finished, g.admitted_at)
        assert g.gid + 1 - done_by_then <= window, (g.gid, g.admitted_at, done_by_then, window)


@EXAMPLES
@given(costs(), delays, runs)
def test_every_group_is_trained_once_or_dropped_once(c, d, run):
    result = simulated(c, d, run)
    total = run["steps"] * c.prompts_per_step
    assert result.groups_admitted == total
    assert sorted(g.gid for g in result.groups) == list(range(total))  # each recorded once
    assert result.groups_trained + result.groups_dropped == total
    assert result.groups_dropped == sum(g.dropped for g in result.groups)
    in_steps = [gid for step in result.step_records for gid in step.groups]
    assert len(in_steps) == len(set(in_steps)) == result.groups_trained  # no group in two steps
    step_of = {gid: step.step for step in result.step_records for gid in step.groups}
    for g in result.groups:
        if g.dropped:
            assert g.consumed_step is None and g.gid not in step_of
        else:
            assert step_of[g.gid] == g.consumed_step
            assert g.updated_version == result.step_records[g.consumed_step - 1].version
    assert [s.step for s in result.step_records] == list(range(1, result.steps + 1))
    assert all(s.groups for s in result.step_records)


@EXAMPLES
@given(costs(), delays, runs)
def test_async_with_k_0_trains_what_sync_trains(c, d, run):
    run = {**run, "k": 0}
    sync = simulate(c, delays=d, **{**run, "schedule": "sync"})
    async0 = simulate(c, delays=d, **{**run, "schedule": "async"})
    assert [s.groups for s in async0.step_records] == [s.groups for s in sync.step_records]
    assert async0.groups_dropped == sync.groups_dropped == 0
    assert async0.groups_regenerated == sync.groups_regenerated == 0


@EXAMPLES
@given(costs(), delays, runs)
def test_regenerate_acts_exactly_on_groups_over_the_bound_at_the_engine(c, d, run):
    """The same run with ``on_stale`` drop and regenerate: the two are the same run until a
    group ends over the bound on its replica, so regenerate regenerates something exactly
    when drop lets a group leave a replica over the bound."""
    dropping = simulated(c, d, {**run, "on_stale": "drop"})
    regenerating = simulate(c, delays=d, **{**run, "on_stale": "regenerate"})
    k = dropping.k
    assert dropping.groups_regenerated == 0
    assert all(g.regenerations == 0 and not g.regenerated_from for g in dropping.groups)
    regenerated = [s for g in regenerating.groups for s in g.regenerated_from]
    assert len(regenerated) == regenerating.groups_regenerated
    assert sum(g.regenerations for g in regenerating.groups) == regenerating.groups_regenerated
    for engine_version, oldest in regenerated:  # over the bound on its replica when it ended
        assert engine_version - oldest > k
    assert over_at_engine(regenerating) <= 0  # nothing leaves a replica over the bound
    assert (regenerating.groups_regenerated > 0) == (over_at_engine(dropping) > 0)
    if over_at_engine(dropping) <= 0:  # nothing to regenerate: the same run
        assert regenerating.groups == dropping.groups
    for g in regenerating.groups:  # what it drops aged past K after leaving its replica
        if g.dropped:
            assert g.emitted_version - g.oldest_version <= k < g.staleness
    if dropping.schedule != "async":  # a static batch is generated with one version
        assert dropping.groups_dropped == regenerating.groups_dropped == 0
        assert regenerating.groups_regenerated == 0


@EXAMPLES
@given(costs(), delays, runs)
def test_colocated_engines_never_step_during_the_trainers_turn(c, d, run):
    result = simulate(c, delays=d, **{**run, "placement": "colocated"})
    turns = [(s.turn_at, s.updated_at) for s in result.step_records]
    for intervals in result.engine_busy:
        for start, end, occupancy, steps in intervals:
            if steps:  # engine steps (a sync, steps 0, ends the turn)
                assert all(end <= a + 1e-9 or start >= b - 1e-9 for a, b in turns), \
                    (start, end, turns)


# ----- hand-checked numbers -----------------------------------------------------------------
def test_decode_step_interpolates_the_occupancy_curve():
    c = CostModel(decode_occupancy=(2, 6), decode_tokens_per_s=(20.0, 60.0),
                  prefill_tokens_per_s=1.0, update_tokens_per_s=1.0)
    assert c.decode_step_s(1) == pytest.approx(0.1)  # below the first point: as slow as it
    assert c.decode_step_s(2) == pytest.approx(2 / 20)
    assert c.decode_step_s(4) == pytest.approx(4 / 40)  # halfway: 40 tokens/s
    assert c.decode_step_s(5) == pytest.approx(5 / 50)
    assert c.decode_step_s(6) == pytest.approx(6 / 60)
    assert c.decode_step_s(12) == pytest.approx(12 / 60)  # beyond the last point: flat rate


def test_a_synchronous_step_takes_generation_reward_update_and_sync():
    c = CostModel(decode_occupancy=(2, 6), decode_tokens_per_s=(20.0, 60.0),
                  prefill_tokens_per_s=1000.0, update_tokens_per_s=440.0, sync_s=0.3,
                  update_overhead_s=0.5, reward_s_per_group=0.25, prompt_tokens=100,
                  n_samples=2, prompts_per_step=2, max_seqs_per_replica=8,
                  response_lengths=LengthDistribution("fixed", 10))
    generate = 200 / 1000 + 10 * c.decode_step_s(4)  # 2 prompts prefilled, 10 steps of 4 sequences
    reward = 2 * 0.25
    update = 2 * (2 * 100 + 2 * 10) / 440 + 0.5
    step = generate + reward + update + 0.3
    assert step == pytest.approx(3.5)
    result = simulate(c, "sync", replicas=1, steps=4)
    assert result.step_times_s == pytest.approx([step] * 4)
    assert result.step_time_s == pytest.approx(step)
    assert result.total_time_s == pytest.approx(4 * step)
    assert result.trained_tokens_per_s == pytest.approx(440 / step)
    assert result.engine_occupancy == pytest.approx(4.0)
    detail = json.loads(json.dumps(result.to_dict(detail=True)))
    assert [g["consumed_step"] for g in detail["groups"]] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [s["groups"] for s in detail["step_records"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]


# ----- bad input ----------------------------------------------------------------------------
GOOD = {"decode_occupancy": [1, 8], "decode_tokens_per_s": [10, 50],
        "prefill_tokens_per_s": 1000, "update_tokens_per_s": 1000}


@pytest.mark.parametrize("change, message", [
    ({"decode_ocupancy": [1, 8]}, "unknown field(s) decode_ocupancy"),
    ({"decode_occupancy": [8, 1]}, "must be strictly ascending"),
    ({"decode_tokens_per_s": [10]}, "must be two non-empty lists of the same length"),
    ({"sync_s": -1}, "sync_s=-1 must be a finite number >= 0"),
    ({"response_lengths": {"kind": "longtail", "median": 300, "p90": 100}},
     "p90=100 must be > the median"),
    ({"response_lengths": {"kind": "fixd"}}, "choose one of fixed, empirical, longtail"),
])
def test_bad_costs_are_refused_with_one_line(change, message):
    with pytest.raises(UsageError) as err:
        CostModel.from_dict({**GOOD, **change})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "asynch"}, "schedule='asynch': choose one of sync, one_step_off, async"),
    ({"schedule": "async", "k": -1}, "k=-1 must be an integer >= 0"),
    ({"on_stale": "keep"}, "on_stale='keep': choose drop or regenerate"),
    ({"replicas": 0}, "must be integers >= 1"),
    ({"delays": {"reward_s": [1.0]}}, "give a Delays (or None)"),
])
def test_bad_runs_are_refused_with_one_line(kwargs, message):
    with pytest.raises(UsageError) as err:
        simulate(CostModel.from_dict(GOOD), **{"steps": 2, **kwargs})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"response_lengths": (3, 0)}, "delays.response_lengths holds 0: give integers >= 1"),
    ({"replica_slowdown": (1.0, 0.0)},
     "delays.replica_slowdown holds 0.0: give finite numbers > 0"),
    ({"reward_s": (float("nan"),)}, "delays.reward_s holds nan"),
    ({"update_extra_s": 5.0}, "delays.update_extra_s=5.0: give a list"),
])
def test_bad_delays_are_refused_when_made(kwargs, message):
    with pytest.raises(UsageError) as err:
        Delays(**kwargs)
    assert message in str(err.value)
