"""The loop of one controller instance, run in the process that calls its function: the
controller's own process, or the first rank of its worker group (the other ranks receive
each call's input from it over their torch.distributed world: `follow`). A batch goes from
its stream straight to the ranks that use it; no process relays it.

It takes items from the instance's input (a stream of the hub, the launch's feed, or the
source's own data, paced by ``max_in_flight``), merges ``batch_items`` of them, runs them
through the controllers fused into this one (in line, no stream between them), calls the
function and puts its results into the output stream; a streaming function gets the input
iterator instead. Without a hub (fused roles on the ranks of a world outside Ray, as the
tests run them) the loop reads its own data and runs to its end, or to `finish_launch`."""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterable, Iterator

from mcore_rl.flow import ray_shim, round_trips, services
from mcore_rl.flow.entries import pack, unpack
from mcore_rl.flow.graph import Factory, build_function
from mcore_rl.flow.plan import OWN, InstanceSpec
from mcore_rl.flow.stats import ControllerStats
from mcore_rl.flow.streams import CANCELLED, ENDED, OPEN


def merge_items(items: list, batch_items: int) -> Any:
    """One call's input: the item itself, or ``batch_items`` (or fewer, at the end) items
    merged: ``Batch.cat`` when all are batches, else a list."""
    if batch_items == 1:
        return items[0]
    batch_module = sys.modules.get("mcore_rl.data.batch")  # loaded if any item is a Batch
    if batch_module is not None and all(isinstance(i, batch_module.Batch) for i in items):
        return batch_module.Batch.cat(items)
    return list(items)


def own_data(data: Any) -> Iterable:
    """A source's ``data``, built in this process when it is a `Factory` (or ``module:attr``)."""
    return build_function(data) if isinstance(data, (Factory, str)) else data


class Stage:
    """A fused controller's function, called in line, with the stats of its role; inside
    ``context()`` when given (e.g. outside Megatron's CPU layer, on a trainer rank)."""

    def __init__(self, role: str, index: int, function: Callable[[Any], Any],
                 context: Callable[[], Any] | None = None):
        self.function, self.context = function, context or contextlib.nullcontext
        self.stats = ControllerStats(role, index)

    def __call__(self, item: Any) -> Any:
        t = time.perf_counter()
        self.stats.items_in += 1
        before = round_trips.total()
        with self.context():
            result = self.function(item)
        self.stats.round_trips += round_trips.total() - before
        self.stats.busy_s += time.perf_counter() - t
        self.stats.calls += 1
        self.stats.items_out += result is not None
        return result

    def close(self) -> None:
        close = getattr(self.function, "close", None)
        if callable(close):
            close()


def close_all(stages: list[Stage], function: Any) -> None:
    """Close the fused stages' functions, then the host's own (each that has ``close``)."""
    for stage in stages:
        stage.close()
    close = getattr(function, "close", None)
    if callable(close):
        close()


class ItemLoop:
    """Items in, function calls, results out, for one instance (see the module doc).

    ``call``: the function (for a worker group: broadcast to the ranks, then the local
    call); ``stream``: the streaming function's driver; ``stages``: the fused stages."""

    def __init__(self, spec: InstanceSpec, hub: Any, call: Callable[[Any], Any],
                 stream: Callable[[Iterator], Iterator] | None = None,
                 stages: list[Stage] | None = None):
        self.spec, self.hub, self.call_function, self.stream = spec, hub, call, stream
        self.stages = stages or []
        self.stats = ControllerStats(spec.role, spec.index)

    def run(self, num_epochs: int | None = 1) -> list[ControllerStats]:
        """Move items until the input ends (or the launch is cancelled or finished); the
        stats of the fused stages' roles and of this one's."""
        spec, hub = self.spec, self.hub
        start = time.perf_counter()
        results = self._streamed(num_epochs) if spec.streaming else self._called(num_epochs)
        for result in results:
            items = len(unpack(result)) if result is not None else 0
            if not items or spec.output is None:
                continue
            if not self._put(result, items):
                break
        if spec.replaceable is not None:  # done: nothing it took goes back to the feed
            ray_shim.require().get(hub.let_go.remote(spec.input, spec.name))
        if spec.output is not None and hub is not None:
            producer = spec.name if spec.replaceable is not None else None
            ray_shim.require().get(hub.close.remote(spec.output, producer))
        self.stats.wall_s = time.perf_counter() - start
        if spec.streaming:  # the function's own time: what was not spent waiting on streams
            self.stats.busy_s = max(0.0, self.stats.wall_s - self.stats.blocked_in_s
                                    - self.stats.blocked_out_s)
        for stage in self.stages:
            stage.stats.wall_s = self.stats.wall_s
        return [s.stats for s in self.stages] + [self.stats]

    def _waited(self, n: int = 1) -> None:
        """``n`` Ray round trips this loop waited on (outside the function's calls)."""
        round_trips.add(n)
        self.stats.round_trips += n

    # ----- output -------------------------------------------------------------------------
    def _put(self, result: Any, items: int) -> bool:
        """Put ``result`` (``items`` items) into the output stream: wait while it is full;
        whether the stream took it (False once the launch is cancelled)."""
        ray = ray_shim.require()
        t = time.perf_counter()
        spec = self.spec
        acks = None if spec.replaceable is None else \
            (spec.input, spec.name, list(spec.replaceable.output_keys(result)))
        accepted = ray.get(self.hub.put.remote(spec.output, [ray.put(result)], None, acks))
        self.stats.blocked_out_s += time.perf_counter() - t
        self.stats.items_out += items if accepted else 0
        self.stats.puts += int(accepted)
        return accepted

    # ----- calls --------------------------------------------------------------------------
    def _called(self, num_epochs: int | None) -> Iterator[Any]:
        """The function called per (merged) input item; its results (a function may return
        `Many` items, or None for none). The results of the calls on one entry's items go on
        together, as one entry."""
        spec, hub = self.spec, self.hub
        ray = ray_shim.require() if hub is not None else None
        together: list = []
        for count, item, entry_done in self._inputs(num_epochs):
            if spec.counts_steps and hub is not None:
                self._waited()
                if not ray.get(hub.take_step.remote()):
                    break
            result = self._call(item)
            if spec.reports_done and hub is not None:
                hub.sink_done.remote(count)  # ordered before this process's next hub call
            if result is not None and spec.output is not None:
                together += unpack(result)
            if entry_done and together:
                yield pack(together)
                together = []
            if services.take_finished():
                break
        if together:  # the launch stopped within an entry
            yield pack(together)

    def _call(self, item: Any) -> Any:
        ray = ray_shim.require() if self.hub is not None else None
        devices = self.spec.devices
        if self.spec.takes_turns:
            t = time.perf_counter()
            self._waited()
            ray.get(self.hub.acquire.remote(devices))
            self.stats.turn_wait_s += time.perf_counter() - t
        try:
            for stage in self.stages:
                item = stage(item)
                if item is None:
                    return None
            t = time.perf_counter()
            before = round_trips.total()
            result = self.call_function(item)
            self.stats.round_trips += round_trips.total() - before
            self.stats.busy_s += time.perf_counter() - t
            self.stats.calls += 1
            return result
        finally:
            if self.spec.takes_turns:
                self.hub.release.remote(devices)

    def _streamed(self, num_epochs: int | None) -> Iterator[Any]:
        """The streaming function, given the input iterator; what it yields."""
        def inputs() -> Iterator[Any]:
            for _, item, _ in self._inputs(num_epochs):
                self.stats.calls += 1
                yield item

        yield from self.stream(inputs())

    # ----- inputs -------------------------------------------------------------------------
    def _inputs(self, num_epochs: int | None) -> Iterator[tuple[int, Any, bool]]:
        """(how many items, the call's input, whether the next call must wait for its
        input: the results so far should go on) until the input ends."""
        if self.spec.input == OWN:
            yield from self._own_items(num_epochs)
        else:
            yield from self._stream_items()

    def _own_items(self, num_epochs: int | None) -> Iterator[tuple[int, Any, bool]]:
        """The source's own data, ``num_epochs`` times (None: until the launch stops it), an
        item at a time, at most ``max_in_flight`` ahead of what the sinks finished."""
        k, window = self.spec.batch_items, self.spec.max_in_flight
        data = own_data(self.spec.data)
        one_shot = iter(data) is data
        taken, group, epoch = 0, [], 0
        while num_epochs is None or epoch < num_epochs:
            fed = 0
            for item in data:
                if window is not None and self.hub is not None and taken >= window:
                    if not self._wait_done(taken - window + 1):
                        return
                group.append(item)
                taken += 1
                fed += 1
                self.stats.items_in += 1
                if len(group) == k:
                    yield k, merge_items(group, k), True
                    group = []
            epoch += 1
            if one_shot or not fed:
                break
        if group:
            yield len(group), merge_items(group, k), True

    def _wait_done(self, n: int) -> bool:
        """Wait for the sinks to finish ``n`` items (one round trip); False if the launch
        is stopping first."""
        t = time.perf_counter()
        self._waited()
        done = ray_shim.require().get(self.hub.wait_done.remote(n))
        self.stats.blocked_in_s += time.perf_counter() - t
        return done is not None

    def _stream_items(self) -> Iterator[tuple[int, Any, bool]]:
        """Items of the input stream. An entry of several items (`Many`) is taken apart: its
        items may go to different calls; a call on items taken earlier first makes sure the
        launch has not been cancelled."""
        ray = ray_shim.require()
        hub, k = self.hub, self.spec.batch_items
        holder = self.spec.name if self.spec.replaceable is not None else None
        group: list = []
        taken: list = []  # items of the entries taken, not yet in a call's input
        state, fetched = OPEN, False
        while True:
            if not taken:
                if state != OPEN:
                    break
                t = time.perf_counter()
                boxes, state = ray.get(hub.get.remote(self.spec.input, k - len(group), holder))
                values = ray.get([box[0] for box in boxes]) if boxes else []
                if boxes:  # the get and the fetch of what it returned (not the end's get)
                    self._waited(2)
                self.stats.blocked_in_s += time.perf_counter() - t
                taken = [item for value in values for item in unpack(value)]
                self.stats.items_in += len(taken)
                fetched = True
                if state == CANCELLED:
                    return
            n = min(k - len(group), len(taken))
            group, taken = group + taken[:n], taken[n:]
            if len(group) == k:
                if not fetched and ray.get(hub.cancelled.remote(self.spec.input)):
                    return
                yield k, merge_items(group, k), len(taken) < k
                group, fetched = [], False
        if group and state == ENDED:
            yield len(group), merge_items(group, k), True
