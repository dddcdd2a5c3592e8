"""``max_in_flight``: the feed keeps at most K items between the sources and the end of the
sinks' calls (K = 1: one item through the whole graph at a time, a synchronous step)."""
from __future__ import annotations

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers


def run(log: str, k: int):
    out = DataStream("out", buffer_size=4)
    group = ControllerGroup([
        Controller("producer", factory(helpers.Numbered, log), data_output=out),
        Controller("sink", factory(helpers.Consume, log, delay_s=0.2), data_input=out)])
    return launch(group, data=list(range(5)), max_in_flight=k)


@pytest.mark.parametrize("k", [1, 2])
def test_sources_run_at_most_max_in_flight_items_ahead_of_the_sinks(ray_cluster, tmp_path, k):
    log = str(tmp_path / "log.jsonl")
    stats = run(log, k)
    records = helpers.read(log)
    produced = [r["t"] for r in records if r["event"] == "produce"]
    consumed = [r["t"] for r in records if r["event"] == "consume"]
    assert len(produced) == len(consumed) == 5 and stats.steps == 5
    for i in range(k, 5):
        # item i is fed only once the sink's call on item i - k has ended (start + 0.2 s)
        assert produced[i] >= consumed[i - k] + 0.2
    if k == 2:  # and no later than needed: the producer does run ahead by one
        assert any(produced[i] < consumed[i - 1] + 0.2 for i in range(1, 5))


def test_max_in_flight_needs_data_and_a_positive_bound():
    out = DataStream("out", 1)
    group = ControllerGroup([Controller("p", helpers.Numbered, data_output=out),
                             Controller("s", helpers.Consume, data_input=out)])
    with pytest.raises(UsageError, match="max_in_flight=0"):
        launch(group, data=[1], max_in_flight=0)
