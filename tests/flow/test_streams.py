"""Streams: backpressure, end-of-stream, order, merged items, tensors, stats."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from mcore_rl.flow import ray_shim
from mcore_rl.flow.controller import ControllerProcess
from mcore_rl.flow.hub import Hub
from mcore_rl.flow.plan import FEED, InstanceSpec
from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers

BUFFER = 3


@pytest.fixture(scope="module")
def fast_to_slow(ray_cluster, tmp_path_factory):
    """A fast producer into a stream of 3 read by a consumer taking 50 ms per item."""
    log = str(tmp_path_factory.mktemp("flow") / "log.jsonl")
    stream = DataStream("numbers", buffer_size=BUFFER)
    group = ControllerGroup([
        Controller("producer", factory(helpers.Numbered, log), data_output=stream),
        Controller("consumer", factory(helpers.Consume, log, delay_s=0.05), data_input=stream)])
    stats = launch(group, data=list(range(16)))
    return helpers.read(log), stats


def test_slow_consumer_keeps_producer_at_most_buffer_size_ahead(fast_to_slow):
    log, _ = fast_to_slow
    consumed = sorted(r["t"] for r in log if r["event"] == "consume")
    ahead = []
    for r in (r for r in log if r["event"] == "produce"):
        # before call `seq` the producer had put `seq` items; at most BUFFER wait in the
        # stream and one may be between the stream and the consumer's log line
        taken = sum(t < r["t"] for t in consumed)
        ahead.append(r["seq"] - taken)
    assert max(ahead) <= BUFFER + 1
    assert max(ahead) >= BUFFER - 1  # it did run ahead: the bound was what held it back


def test_producer_blocked_on_full_stream_shows_blocked_on_output(fast_to_slow):
    _, stats = fast_to_slow
    producer, consumer = stats.roles["producer"], stats.roles["consumer"]
    assert producer.items_out == consumer.items_in == 16
    assert consumer.busy_s >= 16 * 0.05
    # the producer spends the consumer's time waiting for room in the stream
    assert producer.blocked_out_s > 0.5 * consumer.busy_s
    assert producer.blocked_out_s > 10 * producer.busy_s
    for s in stats.instances:
        assert s.busy_s + s.blocked_in_s + s.blocked_out_s <= s.wall_s + 1e-3


def test_consumer_waiting_on_slow_producer_shows_blocked_on_input(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    stream = DataStream("numbers", buffer_size=BUFFER)
    group = ControllerGroup([
        Controller("producer", factory(helpers.Numbered, log, delay_s=0.04), data_output=stream),
        Controller("consumer", factory(helpers.Consume, log), data_input=stream)])
    stats = launch(group, data=list(range(10)))
    producer, consumer = stats.roles["producer"], stats.roles["consumer"]
    assert producer.busy_s >= 10 * 0.04
    # the consumer spends the producer's time waiting for items
    assert consumer.blocked_in_s > 0.5 * producer.busy_s
    assert consumer.blocked_in_s > 10 * consumer.busy_s


@pytest.fixture(scope="module")
def two_producers(ray_cluster, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("flow") / "log.jsonl")
    stream = DataStream("numbers", buffer_size=2)
    group = ControllerGroup()
    for _ in range(2):
        group.add(Controller("producer", factory(helpers.Numbered, log), data_output=stream))
    group.add(Controller("consumer", factory(helpers.Consume, log, delay_s=0.002),
                         data_input=stream))
    stats = launch(group, data=list(range(40)))
    return [r["item"] for r in helpers.read(log) if r["event"] == "consume"], stats


def test_consumer_ends_after_all_producers_with_every_item_once(two_producers):
    items, stats = two_producers
    assert sorted(i["x"] for i in items) == list(range(40))
    assert len({i["pid"] for i in items}) == 2
    assert stats.roles["producer"].items_out == stats.roles["consumer"].items_in == 40
    assert sorted(s.items_out for s in stats.instances[:2]) == sorted(
        Counter(i["pid"] for i in items).values())


def test_items_keep_their_order_per_producer(two_producers):
    items, _ = two_producers
    for pid in {i["pid"] for i in items}:
        seqs = [i["seq"] for i in items if i["pid"] == pid]
        assert seqs == sorted(seqs) == list(range(len(seqs)))


def test_batch_items_merges_lists_and_batches_including_the_last_partial_group(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    numbers, batches = DataStream("numbers", 4), DataStream("batches", 4)
    group = ControllerGroup([
        Controller("source", factory(helpers.Consume, str(tmp_path / "src.jsonl"), relay=True),
                   data_output=numbers),
        Controller("lister", factory(helpers.GroupSizes, log, "lister"), data_input=numbers,
                   data_output=batches, batch_items=3),
        Controller("batcher", factory(helpers.GroupSizes, log, "batcher"), data_input=batches,
                   batch_items=2)])
    launch(group, data=list(range(7)))
    calls = helpers.read(log)
    lists = [c for c in calls if c["role"] == "lister"]
    assert [(c["kind"], c["x"]) for c in lists] == [("list", [0, 1, 2]), ("list", [3, 4, 5]),
                                                     ("list", [6])]
    merged = [c for c in calls if c["role"] == "batcher"]
    assert [(c["kind"], c["rows"], c["x"], c["meta"]) for c in merged] == [
        ("Batch", 6, list(range(6)), list(range(6))), ("Batch", 1, [6], [6])]


def test_tensors_arrive_equal(ray_cluster, tmp_path):
    log = str(tmp_path / "log.jsonl")
    items = DataStream("items", 2)
    group = ControllerGroup([
        Controller("maker", helpers.make_tensors_or_batch, data_output=items),
        Controller("checker", factory(helpers.check_tensors, log), data_input=items)])
    launch(group, data=[1, 2, 3, 4])
    got = helpers.read(log)
    assert [(g["kind"], g["seeds"]) for g in got] == [
        ("dict", [1]), ("dict", [2]), ("Batch", [3]), ("Batch", [4])]
    assert all(g["equal"] for g in got)


def test_streams_hold_object_store_references_not_items(ray_cluster):
    ray = ray_cluster
    hub = ray_shim.actor_class(Hub).options(num_cpus=0).remote({FEED: (1, 1), "out": (2, 1)}, None)
    spec = InstanceSpec(role="maker", index=0, function=helpers.make_tensors, strategy="process",
                        num_workers=1, devices=None, batch_items=1, input=FEED, output="out",
                        takes_turns=False, counts_steps=False)
    maker = ray_shim.actor_class(ControllerProcess).options(num_cpus=0).remote(spec)
    try:
        ray.get(maker.setup.remote())
        ray.get(hub.put.remote(FEED, [ray.put(7)]))
        ray.get(hub.close.remote(FEED))
        (stats,) = ray.get(maker.run.remote(hub))
        assert stats.items_out == 1
        (box,) = ray.get(hub.peek.remote("out"))
        assert isinstance(box[0], ray.ObjectRef)
        assert torch.equal(ray.get(box[0])["w"], helpers.tensors(7)["w"])
    finally:
        ray.kill(maker)
        ray.kill(hub)
