"""The first failure ends the launch at once, names its role and instance, and leaves no
process behind (checked by PID: the controllers' and the children they started)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from mcore_rl.flow import Controller, ControllerGroup, DataStream, FlowError, factory, launch
from tests.flow import helpers

LIMIT_S = 30.0


def three_roles(log: str, failing: str, how: str = "raise") -> ControllerGroup:
    """actor (two instances) -> critic -> trainer; ``failing`` ("actor#1", "critic#0", ...)
    fails on its third item; every instance starts a child process."""
    rollout, reward = DataStream("rollout", 2), DataStream("reward", 2)

    def faulty(name: str):
        return factory(helpers.Faulty, log, name, fail_at=3 if name == failing else None, how=how)

    group = ControllerGroup()
    for i in range(2):
        group.add(Controller("actor", faulty(f"actor#{i}"), data_output=rollout))
    group.add(Controller("critic", faulty("critic#0"), data_input=rollout, data_output=reward))
    group.add(Controller("trainer", faulty("trainer#0"), data_input=reward))
    return group


def assert_all_gone(log: str, expected: int) -> None:
    started = helpers.read(log)
    assert len(started) == expected
    pids = [r["pid"] for r in started] + [r["child"] for r in started if "child" in r]
    deadline = time.monotonic() + 5.0  # SIGKILL is asynchronous; the kernel takes a moment
    while any(helpers.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if helpers.alive(p)] == []


@pytest.mark.parametrize("failing", ["actor#1", "critic#0", "trainer#0"])
def test_an_error_in_any_role_ends_the_launch_naming_it_and_kills_every_process(
        ray_cluster, tmp_path, failing):
    log = str(tmp_path / "log.jsonl")
    start = time.monotonic()
    with pytest.raises(FlowError) as caught:
        launch(three_roles(log, failing), data=list(range(1000)))
    assert time.monotonic() - start < LIMIT_S
    role, index = failing.split("#")
    first_line = str(caught.value).splitlines()[0]
    assert f"'{role}' #{index}" in first_line
    assert f"ValueError: bad item in {failing}" in first_line
    assert (caught.value.role, caught.value.index, caught.value.cause_type) == (
        role, int(index), "ValueError")
    assert_all_gone(log, expected=4)


def test_a_worker_process_that_exits_is_reported_with_its_role(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    start = time.monotonic()
    with pytest.raises(FlowError, match=r"controller 'critic' #0 failed while running: its "
                                        r"process \(pid \d+\) died") as caught:
        launch(three_roles(log, "critic#0", how="exit"), data=list(range(1000)))
    assert time.monotonic() - start < LIMIT_S
    assert caught.value.role == "critic"
    assert_all_gone(log, expected=4)


def test_a_worker_process_killed_from_outside_is_reported_with_its_role(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")

    def kill_the_trainer() -> None:  # once it runs, hanging on an item
        while not os.path.exists(f"{log}.trainer#0.hanging"):
            time.sleep(0.05)
        trainer = next(r for r in helpers.read(log) if r["name"] == "trainer#0")
        os.kill(trainer["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_trainer, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(FlowError, match=r"controller 'trainer' #0 failed while running: its "
                                        r"process \(pid \d+\) died"):
        launch(three_roles(log, "trainer#0", how="hang"), data=list(range(1000)))
    assert time.monotonic() - start < LIMIT_S
    killer.join(timeout=1)
    assert_all_gone(log, expected=4)


def test_an_error_while_building_the_function_names_the_role(ray_cluster):
    group = ControllerGroup([Controller("loader", "tests.flow.helpers:no_such_function")])
    with pytest.raises(FlowError, match=r"controller 'loader' #0 failed while setting up: "
                                        r"UsageError: module 'tests.flow.helpers' has no attribute"):
        launch(group, data=[1])


def test_a_failing_rank_of_a_worker_group_ends_the_launch_while_the_others_wait(
        ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    sums = DataStream("sums", 2)
    group = ControllerGroup([
        Controller("trainer", factory(helpers.RankSum, log, fail_rank=1, fail_at=2),
                   data_output=sums, strategy="worker_group", num_workers=2),
        Controller("sink", factory(helpers.Consume, str(tmp_path / "sink.jsonl")), data_input=sums)])
    start = time.monotonic()
    with pytest.raises(FlowError, match=r"controller 'trainer' #0 failed while running: "
                                        r"RuntimeError: rank 1 failed"):
        launch(group, data=list(range(10)))
    assert time.monotonic() - start < LIMIT_S
    assert_all_gone(log, expected=2)


def broken_data():
    yield 1
    raise KeyError("no more prompts")


def test_data_that_fails_ends_the_launch_with_its_error(ray_cluster, tmp_path):
    stream = DataStream("items", 2)
    group = ControllerGroup([
        Controller("source", factory(helpers.Consume, str(tmp_path / "a.jsonl"), relay=True),
                   data_output=stream),
        Controller("sink", factory(helpers.Consume, str(tmp_path / "b.jsonl")), data_input=stream)])
    with pytest.raises(FlowError, match=r"the launch's data failed: KeyError: 'no more prompts'"):
        launch(group, data=broken_data())


def test_a_function_its_process_cannot_import_is_reported_at_start(ray_cluster, tmp_path,
                                                                  monkeypatch):
    (tmp_path / "only_on_the_driver.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver's path, not the actors'
    from only_on_the_driver import double

    group = ControllerGroup([Controller("loader", double)])
    with pytest.raises(FlowError, match=r"controller 'loader' #0 failed while starting: "
                                        r"ModuleNotFoundError: No module named 'only_on_the_driver'"):
        launch(group, data=[1])
