"""Devices on CPU: pinned cores read back from inside the actor, light controllers reserve
no core, shared devices take turns, disjoint devices overlap."""
from __future__ import annotations

import itertools

import pytest

from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers
from tests.flow.conftest import CORES

TWO_CORES = len(CORES) >= 2


@pytest.mark.timeout(120)  # a controller reserving a core would leave the rest unplaced
def test_pinned_controllers_run_on_their_cores_and_light_ones_reserve_none(ray_cluster, tmp_path):
    """Two pinned controllers and six light ones in a chain, on a machine of two cores:
    each item collects where every stage ran it (the threads that call the function)."""
    log = str(tmp_path / "log.jsonl")
    pinned = {"pinned0": [CORES[0]], "pinned1": [CORES[-1]]}
    placed = [*pinned, *(f"light{i}" for i in range(5))]
    streams = [DataStream(f"s{i}", 2) for i in range(len(placed))]
    group = ControllerGroup()
    for i, name in enumerate(placed):
        group.add(Controller(name, factory(helpers.Placed, log, name), devices=pinned.get(name),
                             data_input=streams[i - 1] if i else None, data_output=streams[i]))
    group.add(Controller("collect", factory(helpers.Consume, log), data_input=streams[-1]))
    stats = launch(group, data=[1, 2, 3])
    assert stats.roles["collect"].items_in == 3
    records = helpers.read(log)
    built = {r["name"]: r for r in records if r.get("at") == "build"}
    assert set(built) == set(placed)
    calls = [report for r in records if r.get("event") == "consume" for report in r["item"]]
    assert len(calls) == 3 * len(placed)
    for report in [*built.values(), *calls]:
        if report["name"] in pinned:
            cores = pinned[report["name"]]
            assert (report["cores"], report["threads"]) == (cores, len(cores))
        else:
            assert report["cores"] == CORES  # not pinned
        assert report["free_cpus"] == len(CORES)  # no controller reserved a CPU of Ray's


def overlapping(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_controllers_sharing_a_core_take_turns_and_producer_and_consumer_do_not_deadlock(
        ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stream = DataStream("items", buffer_size=1)
    group = ControllerGroup()
    for i in range(2):
        group.add(Controller("actor", factory(helpers.Interval, log, f"actor{i}", 0.03),
                             data_output=stream, devices=[CORES[0]]))
    group.add(Controller("trainer", factory(helpers.Interval, log, "trainer", 0.03, relay=False),
                         data_input=stream, devices=[CORES[0]]))
    stats = launch(group, data=list(range(12)))
    calls = helpers.read(log)
    assert len(calls) == 24
    clashes = [(a["name"], b["name"]) for a, b in itertools.combinations(calls, 2)
               if overlapping(a, b)]
    assert clashes == []
    assert stats.roles["trainer"].turn_wait_s > 0


def test_controllers_on_different_cores_run_at_the_same_time(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stream = DataStream("items", buffer_size=4)
    second = CORES[1] if TWO_CORES else CORES[0]
    group = ControllerGroup([
        Controller("actor", factory(helpers.Interval, log, "actor", 0.1), data_output=stream,
                   devices=[CORES[0]]),
        Controller("trainer", factory(helpers.Interval, log, "trainer", 0.1, relay=False),
                   data_input=stream, devices=[second])])
    stats = launch(group, data=list(range(5)))
    calls = helpers.read(log)
    actor = [c for c in calls if c["name"] == "actor"]
    trainer = [c for c in calls if c["name"] == "trainer"]
    if TWO_CORES:
        assert any(overlapping(a, t) for a in actor for t in trainer)
        assert stats.roles["actor"].turn_wait_s == 0
    else:  # one core: they share it, so they take turns
        assert not any(overlapping(a, t) for a in actor for t in trainer)
