"""Controllers fused into another (`Controller.fused_with`): they run in line in its first
rank, with no stream and no Ray round trip between them; a driver calls a started graph's
controllers itself (`flow.start`); `launch(group, num_epochs)` with a source reading its own
data."""
from __future__ import annotations

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch, start
from mcore_rl.flow.plan import build_plan
from tests.flow import helpers


def fused_group(log: str, data) -> ControllerGroup:
    made, scored = DataStream("made"), DataStream("scored")
    return ControllerGroup([
        Controller("make", factory(helpers.Stamp, log, "make"), data=data, data_output=made,
                   fused_with="trainer"),
        Controller("score", factory(helpers.Stamp, log, "score"), data_input=made,
                   data_output=scored, fused_with="trainer"),
        Controller("trainer", factory(helpers.RankLog, log), data_input=scored,
                   strategy="worker_group", num_workers=2)])


def test_fused_stages_run_in_the_first_rank_each_item_reaching_every_rank_in_order(
        ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stats = launch(fused_group(log, [10, 11, 12]), 2)  # the HybridFlow call: two epochs
    records = helpers.read(log)
    ranks = {r["rank"]: r["pid"] for r in records if r["event"] == "rank_call"}
    assert {r["pid"] for r in records if r["event"] in ("make", "score")} == {ranks[0]}
    for rank in (0, 1):
        assert [r["item"]["x"] for r in records if r["event"] == "rank_call" and r["rank"] == rank] \
            == [10, 11, 12] * 2
    assert all(r["item"]["make"] == r["item"]["score"] == ranks[0]
               for r in records if r["event"] == "rank_call")
    assert [stats.roles[r].calls for r in ("make", "score", "trainer")] == [6, 6, 6]
    assert stats.round_trips_per_step == 0  # nothing crossed Ray
    assert stats.steps == 6


def test_a_driver_calls_the_fused_stage_and_the_group_of_a_started_graph(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    graph = start(fused_group(log, None))
    try:
        reply = graph.call("make", "hello", "driver")
        out = graph.call("trainer", "__call__", 5)
        ranks = {r["rank"]: r["pid"] for r in helpers.read(log) if r["event"] == "rank_call"}
        assert reply == f"make says hello to driver from {ranks[0]}"
        assert out == {"item": 5, "pid": ranks[0]} and set(ranks) == {0, 1}
        with pytest.raises(UsageError, match="no controller 'critic'"):
            graph.call("critic", "__call__", 1)
    finally:
        graph.close()


def test_a_fused_controller_must_lead_into_its_host():
    s, t = DataStream("s"), DataStream("t")
    group = ControllerGroup([
        Controller("a", helpers.write, data=[1], data_output=s),
        Controller("side", helpers.write, data_input=s, data_output=t, fused_with="host"),
        Controller("host", helpers.write, data=[1]),
        Controller("sink", helpers.write, data_input=t)])
    with pytest.raises(UsageError, match="'side' is fused with 'host' but does not lead into it"):
        build_plan(group, False, None)
    with pytest.raises(UsageError, match="fused with 'nobody', which must be one controller"):
        build_plan(ControllerGroup([Controller("x", helpers.write, data=[1], fused_with="nobody")]),
                   False, None)


def test_launch_positional_num_epochs_must_be_a_number():
    with pytest.raises(UsageError, match="num_epochs must be an int, got list"):
        launch(ControllerGroup([Controller("only", helpers.write)]), [1, 2])
