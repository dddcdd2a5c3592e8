"""Graphs that cannot run are refused with one line before anything starts (no Ray)."""
from __future__ import annotations

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow import STRATEGIES, Controller, ControllerGroup, DataStream, launch, ray_shim
from mcore_rl.flow.plan import FEED, build_plan


def noop(item):
    return item


def test_a_stream_nobody_reads_is_refused():
    out = DataStream("rollout")
    group = ControllerGroup([Controller("actor", noop, data_output=out)])
    with pytest.raises(UsageError, match="stream 'rollout' has producers but no controller reads it"):
        build_plan(group, has_data=True, steps=None)


def test_a_stream_nobody_writes_is_refused():
    group = ControllerGroup([Controller("trainer", noop, data_input=DataStream("reward"))])
    with pytest.raises(UsageError, match="stream 'reward' has consumers but no controller writes"):
        build_plan(group, has_data=False, steps=None)


def test_two_streams_with_one_name_are_refused():
    a, b = DataStream("x"), DataStream("x")
    group = ControllerGroup([Controller("p", noop, data_output=a),
                             Controller("c", noop, data_input=b)])
    with pytest.raises(UsageError, match="two different streams are named 'x'"):
        build_plan(group, has_data=True, steps=None)


def test_sources_need_data_and_data_needs_sources():
    s = DataStream("s")
    with pytest.raises(UsageError, match="launch needs data="):
        build_plan(ControllerGroup([Controller("p", noop, data_output=s),
                                    Controller("c", noop, data_input=s)]), False, None)
    t = DataStream("t")
    cycle = ControllerGroup([Controller("a", noop, data_input=s, data_output=t),
                             Controller("b", noop, data_input=t, data_output=s)])
    with pytest.raises(UsageError, match="no controller is a source"):
        build_plan(cycle, has_data=True, steps=3)


def test_a_cycle_without_steps_is_refused_and_with_steps_is_planned():
    s, t = DataStream("s"), DataStream("t")
    group = ControllerGroup([Controller("a", noop, data_input=s, data_output=t),
                             Controller("b", noop, data_input=t, data_output=s),
                             Controller("c", noop, data_input=t)])
    with pytest.raises(UsageError, match="cycle"):
        build_plan(group, has_data=False, steps=None)
    plan = build_plan(group, has_data=False, steps=3)
    assert [(i.role, i.counts_steps) for i in plan.instances] == [
        ("a", False), ("b", False), ("c", True)]


def test_instances_are_numbered_per_role_and_shared_devices_take_turns():
    out = DataStream("rollout", buffer_size=5)
    actor = Controller("actor", noop, data_output=out, devices=[0])
    group = ControllerGroup([actor, actor, Controller("critic", noop, data_input=out, devices=[1])])
    plan = build_plan(group, has_data=True, steps=None)
    assert [(i.role, i.index, i.takes_turns) for i in plan.instances] == [
        ("actor", 0, True), ("actor", 1, True), ("critic", 0, False)]
    assert plan.streams == {"rollout": (5, 2), FEED: (4, 1)}


@pytest.mark.parametrize("kwargs, match", [
    ({"devices": [0, 0]}, "distinct device ids"),
    ({"devices": []}, "distinct device ids"),
    ({"batch_items": 0}, "batch_items and num_workers must be >= 1"),
    ({"function": 42}, "function must be callable"),
])
def test_bad_controller_settings_are_refused(kwargs, match):
    with pytest.raises(UsageError, match=match):
        Controller(**{"role": "actor", "function": noop, **kwargs})


def test_stream_sizes_must_be_positive():
    with pytest.raises(UsageError, match="buffer_size must be >= 1"):
        DataStream("s", buffer_size=0)


def test_strategies_has_process_and_worker_group():
    assert {"process", "worker_group"} <= set(STRATEGIES.names())


def test_launch_without_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(ray_shim, "available", lambda: False)
    with pytest.raises(UsageError, match=r"pip install ray"):
        launch(ControllerGroup([Controller("only", noop)]), data=[1])


def test_an_unknown_strategy_is_refused_before_ray_starts():
    group = ControllerGroup([Controller("only", noop, strategy="megatron_group")])
    with pytest.raises(UsageError, match="unknown controller strategy 'megatron_group'"):
        launch(group, data=[1])
