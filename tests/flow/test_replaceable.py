"""Replaceable instances: when one of several instances of a role dies, the launch goes on
with the others, what it had taken and not handed on is fed to them, every item reaches the
sink exactly once; the launch fails once none is left."""
from __future__ import annotations

import pytest

from mcore_rl.flow import (Controller, ControllerGroup, DataStream, FlowError, Replaceable,
                           factory, launch)
from tests.flow import helpers

ITEMS = 40
REPLACEABLE = Replaceable(helpers.item_key, helpers.output_keys)


def replicas(log: str, die_at: list[int | None], **each: list) -> ControllerGroup:
    """Two or more `helpers.Holding` replicas (``die_at`` and the lists in ``each``: their
    arguments, one per replica) feeding one sink."""
    out = DataStream("out", 4)
    group = ControllerGroup()
    for i, die in enumerate(die_at):
        kwargs = {name: values[i] for name, values in each.items()}
        group.add(Controller("work", factory(helpers.Holding, log, f"work#{i}", die_at=die,
                                             **kwargs),
                             data_output=out, streaming=True, replaceable=REPLACEABLE))
    group.add(Controller("sink", factory(helpers.Consume, log), data_input=out))
    return group


def test_a_dead_replica_is_replaced_and_every_item_reaches_the_sink_once(ray_cluster, tmp_path,
                                                                          capfd):
    log = str(tmp_path / "log.jsonl")
    stats = launch(replicas(log, [None, 5]), data=list(range(ITEMS)), max_in_flight=12)
    records = helpers.read(log)
    consumed = sorted(r["item"]["x"] for r in records if r["event"] == "consume")
    assert consumed == list(range(ITEMS))  # none lost, none twice
    taken_by_dead = [r["x"] for r in records if r["event"] == "take" and r["by"] == "work#1"]
    handed_on = {r["item"]["x"] for r in records
                 if r["event"] == "consume" and r["item"]["by"] == "work#1"}
    unfinished = [x for x in taken_by_dead if x not in handed_on]
    assert len(taken_by_dead) == 5 and unfinished, taken_by_dead  # it died holding items
    assert stats.lost == ["'work' #1"] and stats.requeued == len(unfinished)
    err = capfd.readouterr().err
    assert "controller 'work' #1 failed while running: its process" in err
    assert "going on with 1 of 2 'work' instances" in err


def test_the_launch_fails_once_no_replica_is_left(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    with pytest.raises(FlowError) as caught:
        launch(replicas(log, [4, 6]), data=list(range(ITEMS)), max_in_flight=12)
    first = str(caught.value).splitlines()[0]
    assert "failed while running: its process" in first, first
    assert first.endswith("no other instance of 'work' is left"), first


def test_a_replica_dying_after_the_feed_ended_still_has_its_items_finished(ray_cluster, tmp_path):
    """The other replica has taken the last fed item by then: it must not see the feed's end
    while the dying one holds items that may come back."""
    log, items = str(tmp_path / "log.jsonl"), list(range(10))
    # work#1 takes three items first, then dies 0.5 s later as it hands on the first, long
    # after work#0 has taken the other seven and the feed has ended
    stats = launch(replicas(log, [None, None], start_s=[0.2, 0.0], delay_s=[0.01, 0.5],
                            die_on_emit=[None, 1]), data=items)
    records = helpers.read(log)
    consumed = sorted(r["item"]["x"] for r in records if r["event"] == "consume")
    taken_by_dead = [r["x"] for r in records if r["event"] == "take" and r["by"] == "work#1"]
    assert consumed == items and stats.lost == ["'work' #1"]
    assert stats.requeued == len(taken_by_dead) > 0


def test_a_dead_replicas_waiting_take_gets_nothing_of_what_went_back(ray_cluster, tmp_path):
    """The hub still serves a dead caller's call: work#1's reader waits in a take (the feed
    is paced) when it dies; what goes back to the feed must reach work#0, not that call."""
    log, items = str(tmp_path / "log.jsonl"), list(range(10))
    stats = launch(replicas(log, [None, None], start_s=[0.3, 0.0], delay_s=[0.01, 0.5],
                            hold=[3, 5], die_on_emit=[None, 1]), data=items, max_in_flight=4)
    records = helpers.read(log)
    consumed = sorted(r["item"]["x"] for r in records if r["event"] == "consume")
    assert consumed == items and stats.lost == ["'work' #1"]
    assert stats.requeued == len([r for r in records if r["event"] == "take"
                                  and r["by"] == "work#1"]) == 4


def test_a_replica_that_lost_the_hub_is_not_replaced_the_launch_fails(ray_cluster, tmp_path,
                                                                       capfd):
    """Every instance fails when the hub dies: that is no replica's own failure."""
    import os
    import signal
    import threading

    log = str(tmp_path / "log.jsonl")

    def kill_the_hub(processes: dict) -> None:
        threading.Timer(0.5, os.kill, args=(processes["hub"][0], signal.SIGKILL)).start()

    with pytest.raises(FlowError) as caught:
        launch(replicas(log, [None, None], delay_s=[0.2, 0.2]), data=list(range(ITEMS)),
               on_started=kill_the_hub)
    assert "the stream hub (pid " in str(caught.value).splitlines()[0]
    assert "going on with" not in capfd.readouterr().err


def test_a_replaceable_role_takes_one_item_per_call():
    from mcore_rl.errors import UsageError

    with pytest.raises(UsageError, match=r"one item per call \(batch_items=1\)"):
        Controller("work", helpers.Consume, data_output=DataStream("out", 2), batch_items=2,
                   replaceable=REPLACEABLE)
