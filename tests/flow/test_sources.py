"""Sources and the end of a launch: data to exactly one source instance per epoch; steps."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers


def test_each_data_item_reaches_exactly_one_source_instance_per_epoch(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stream = DataStream("numbers", buffer_size=4)
    group = ControllerGroup()
    for _ in range(2):
        group.add(Controller("source", factory(helpers.Numbered, log), data_output=stream))
    group.add(Controller("sink", factory(helpers.Consume, log), data_input=stream))
    stats = launch(group, data=list(range(10)), num_epochs=3)
    produced = [r for r in helpers.read(log) if r["event"] == "produce"]
    assert Counter(r["x"] for r in produced) == {x: 3 for x in range(10)}
    per_instance = [s.items_in for s in stats.instances if s.role == "source"]
    assert sum(per_instance) == 30
    assert sorted(per_instance) == sorted(Counter(r["pid"] for r in produced).values())
    assert stats.roles["sink"].items_in == 30


def test_steps_stops_after_that_many_sink_calls_repeating_the_data(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stream, pairs = DataStream("numbers", buffer_size=2), DataStream("pairs", buffer_size=2)
    group = ControllerGroup([
        Controller("source", factory(helpers.Consume, str(tmp_path / "src.jsonl"), relay=True),
                   data_output=stream),
        Controller("middle", factory(helpers.Consume, str(tmp_path / "mid.jsonl"), relay=True),
                   data_input=stream, data_output=pairs),
        Controller("sink", factory(helpers.Consume, log, delay_s=0.01), data_input=pairs,
                   batch_items=2)])
    stats = launch(group, data=[0, 1, 2], steps=5)  # 10 items: the data three times and more
    calls = [r["item"] for r in helpers.read(log)]
    assert len(calls) == stats.steps == stats.roles["sink"].calls == 5
    assert [x for pair in calls for x in pair] == [0, 1, 2] * 3 + [0]


def test_steps_ends_an_endless_data_iterator_with_exactly_that_many_calls_of_two_sinks(
        ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stream = DataStream("numbers", buffer_size=4)
    group = ControllerGroup([
        Controller("source", factory(helpers.Numbered, str(tmp_path / "src.jsonl")),
                   data_output=stream)])
    for _ in range(2):
        group.add(Controller("sink", factory(helpers.Consume, log, delay_s=0.02),
                             data_input=stream))
    stats = launch(group, data=itertools.count(), steps=6)
    xs = [r["item"]["x"] for r in helpers.read(log)]
    assert len(xs) == len(set(xs)) == stats.steps == 6
    assert min(s.calls for s in stats.instances if s.role == "sink") > 0  # both took part


def test_a_one_shot_iterator_cannot_be_read_for_several_epochs():
    group = ControllerGroup([Controller("only", helpers.placement)])
    with pytest.raises(UsageError, match="one-shot iterator"):
        launch(group, data=iter([1, 2]), num_epochs=2)
