"""Several items as one stream entry (`Many`): consumers take them one by one, in order, as
if each had been put alone; a call's ``batch_items`` may split an entry; a relay hands on
the results of one entry's items as one entry; the stats count items and entries apart;
the feed puts the items it admits at once together, and pacing still counts items."""
from __future__ import annotations

from mcore_rl.flow import Controller, ControllerGroup, DataStream, factory, launch
from tests.flow import helpers


def test_items_put_together_are_taken_one_by_one_in_order_and_counted_as_items(ray_cluster,
                                                                             tmp_path):
    log, sink_log = str(tmp_path / "log.jsonl"), str(tmp_path / "sink.jsonl")
    produced, relayed = DataStream("produced", 2), DataStream("relayed", 2)
    group = ControllerGroup([
        Controller("engine", factory(helpers.Chunked, 4), data_output=produced, streaming=True),
        Controller("relay", factory(helpers.Consume, log, relay=True), data_input=produced,
                   data_output=relayed),
        Controller("sink", factory(helpers.Consume, sink_log), data_input=relayed,
                   batch_items=3)])
    stats = launch(group, data=list(range(10)))  # entries of 4, 4 and 2 items
    relayed_items = [r["item"]["x"] for r in helpers.read(log)]
    sink_calls = [r["item"] for r in helpers.read(sink_log)]
    assert relayed_items == list(range(10))  # one by one, in order
    # calls of 3 items: the entries of 4 split across calls; the last call takes the rest
    assert [[i["x"] for i in call] for call in sink_calls] == \
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    engine, relay, sink = (stats.roles[r] for r in ("engine", "relay", "sink"))
    assert (engine.items_out, engine.puts) == (10, 3)
    assert (relay.items_in, relay.calls, relay.items_out, relay.puts) == (10, 10, 10, 3)
    assert (sink.items_in, sink.calls) == (10, 4) and stats.steps == 4


def test_the_feed_puts_the_items_it_admits_at_once_together_and_pacing_counts_items(
        ray_cluster, tmp_path):
    """max_in_flight 8 over one source: entries of up to 4 items (half the window); an item
    is fed only once the sink has finished all but 8 of the items before it."""
    log = str(tmp_path / "log.jsonl")
    out = DataStream("out", 8)
    group = ControllerGroup([
        Controller("producer", factory(helpers.Numbered, log), data_output=out),
        Controller("trainer", factory(helpers.Consume, log, delay_s=0.1), data_input=out,
                   batch_items=4)])
    stats = launch(group, data=list(range(16)), max_in_flight=8)
    records = helpers.read(log)
    produced = [r["t"] for r in records if r["event"] == "produce"]
    calls = [r["t"] for r in records if r["event"] == "consume"]
    producer = stats.roles["producer"]
    assert producer.items_in == producer.items_out == 16 and producer.calls == 16
    assert producer.puts == 4  # the feed's entries of 4, relayed as entries of 4
    assert [len(c["item"]) for c in records if c["event"] == "consume"] == [4] * 4
    for item in range(8, 16):  # item i waits for the sink call that finished item i - 8
        assert produced[item] >= calls[(item - 8) // 4] + 0.1


def test_a_relay_hands_on_its_results_before_it_waits_for_more_input(ray_cluster, tmp_path):
    """An entry of 3 items into calls of 2: the result of the first call goes on before the
    relay waits for the item its second call lacks (here, the source sends more only once
    the sink has had something)."""
    sink_log = str(tmp_path / "sink.jsonl")
    produced, relayed = DataStream("produced", 2), DataStream("relayed", 2)
    group = ControllerGroup([
        Controller("engine", factory(helpers.AfterSink, sink_log), data_output=produced,
                   streaming=True),
        Controller("relay", factory(helpers.Consume, str(tmp_path / "relay.jsonl"), relay=True),
                   data_input=produced, data_output=relayed, batch_items=2),
        Controller("sink", factory(helpers.Consume, sink_log), data_input=relayed)])
    stats = launch(group, data=list(range(6)))
    sink_calls = [[i["x"] for i in r["item"]] for r in helpers.read(sink_log)]
    assert sink_calls == [[0, 1], [2, 3], [4, 5]]
    assert stats.roles["relay"].items_out == 3


def test_items_taken_earlier_are_not_called_on_once_the_launch_is_finished(ray_cluster,
                                                                          tmp_path):
    """A sink of calls of 2 that takes one entry of 6 items and ends the launch at its first
    call: no call on the 4 items it still holds."""
    log = str(tmp_path / "log.jsonl")
    out = DataStream("out", 2)
    group = ControllerGroup([
        Controller("engine", factory(helpers.Chunked, 6), data_output=out, streaming=True),
        Controller("sink", factory(helpers.FinishAtFirstCall, log), data_input=out,
                   batch_items=2)])
    stats = launch(group, data=list(range(6)))
    assert [r["x"] for r in helpers.read(log)] == [[0, 1]]
    assert stats.roles["sink"].calls == 1
