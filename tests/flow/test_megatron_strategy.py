"""The Megatron strategy: a controller's function runs on tp*pp*dp ranks with Megatron's
model-parallel state set up on each, and the controller passes on rank 0's result."""
from __future__ import annotations

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow import Controller, ControllerGroup, DataStream, Megatron, factory, launch, rank_context
from tests.flow import helpers


def test_a_megatron_controller_runs_its_function_on_each_rank_of_its_layout(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    out = DataStream("out", 2)
    group = ControllerGroup([
        Controller("trainer", factory(helpers.LayoutReport, log), data_output=out,
                   strategy=Megatron(tp=2, pp=1, dp=2)),
        Controller("sink", factory(helpers.Consume, log), data_input=out)])
    stats = launch(group, data=[1, 2, 3])
    records = helpers.read(log)
    ranks = sorted((r["rank"], r["tp_rank"], r["pp_rank"], r["dp_rank"])
                   for r in records if "tp_rank" in r)
    # Megatron's order: TP fastest, then DP (PP outermost).
    assert ranks == [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 0, 1), (3, 1, 0, 1)]
    assert len({r["pid"] for r in records if "tp_rank" in r}) == 4
    consumed = [r["item"] for r in records if r.get("event") == "consume"]
    # rank 0's result: x * (1 + 2) over its TP group {0, 1}
    assert consumed == [{"x": x, "tp_sum": 3.0 * x, "rank": 0, "layout": "TP2xPP1xDP2"}
                        for x in (1, 2, 3)]
    assert stats.instances[0].items_out == 3


def test_megatron_strategy_sets_num_workers_and_refuses_a_conflict():
    c = Controller("t", helpers.Consume, strategy=Megatron(tp=2, pp=2))
    assert c.num_workers == 4
    with pytest.raises(UsageError, match="num_workers=3 conflicts"):
        Controller("t", helpers.Consume, strategy=Megatron(tp=2), num_workers=3)
    with pytest.raises(UsageError, match="tp must be >= 1"):
        Megatron(tp=0)
    with pytest.raises(UsageError, match="strategy=Megatron"):
        rank_context()
