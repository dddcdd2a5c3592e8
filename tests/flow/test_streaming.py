"""Streaming controllers: the function takes the input iterator and yields outputs when they
are ready (several inputs in flight, outputs in another order), every item once; pacing with
``max_in_flight`` counts the items a sink merged, not its calls."""
from __future__ import annotations

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers


def test_a_streaming_function_holds_several_items_and_every_item_comes_out_once(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    out = DataStream("out", 8)
    group = ControllerGroup([
        Controller("engine", factory(helpers.Reorder, log, 3), data_output=out, streaming=True),
        Controller("sink", factory(helpers.Consume, log), data_input=out)])
    stats = launch(group, data=list(range(7)))
    consumed = [r["item"]["x"] for r in helpers.read(log) if r.get("event") == "consume"]
    assert sorted(consumed) == list(range(7)) and consumed != list(range(7))
    engine = stats.roles["engine"]
    assert engine.items_in == engine.items_out == 7 and engine.calls == 7


def _paced(log: str, k: int):
    out = DataStream("out", 8)
    group = ControllerGroup([
        Controller("producer", factory(helpers.Numbered, log), data_output=out),
        Controller("trainer", factory(helpers.Consume, log, delay_s=0.2), data_input=out,
                   batch_items=3)])
    return launch(group, data=list(range(9)), max_in_flight=k)


def test_pacing_counts_the_items_a_sink_call_merged(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stats = _paced(log, 3)  # one sink call's worth in flight: a synchronous step of 3 items
    records = helpers.read(log)
    produced = [r["t"] for r in records if r["event"] == "produce"]
    calls = [r["t"] for r in records if r["event"] == "consume"]
    assert len(produced) == 9 and len(calls) == 3 and stats.steps == 3
    for call in range(1, 3):  # the items of call c are fed only after call c - 1 ended
        assert min(produced[3 * call:3 * call + 3]) >= calls[call - 1] + 0.2


def test_a_streaming_sink_or_a_streaming_worker_group_is_refused():
    out = DataStream("out", 1)
    with pytest.raises(UsageError, match="streaming function needs a data_output"):
        launch(ControllerGroup([Controller("p", helpers.Numbered, data_output=out),
                                Controller("s", helpers.Consume, data_input=out, streaming=True)]),
               data=[1])
    with pytest.raises(UsageError, match="runs in one process"):
        Controller("s", helpers.Consume, strategy="worker_group", streaming=True)
