"""One controller instance at run time: a Ray actor that takes items from its input
stream, calls its function (through its strategy) and puts the results into its output.

The actor is threaded so that `kill_group`, and calls on the objects it published
(`mcore_rl.flow.services`), can run while `run` blocks. Its
process leads its own process group, so killing the group also kills whatever the
function started."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Iterator

from mcore_rl.flow import ray_shim, services
from mcore_rl.flow.entries import pack, unpack
from mcore_rl.flow.hub import CANCELLED, ENDED, OPEN
from mcore_rl.flow.plan import InstanceSpec
from mcore_rl.flow.stats import ControllerStats
from mcore_rl.flow.strategies import Executor, resolve_strategy


def merge_items(items: list, batch_items: int) -> Any:
    """One call's input: the item itself, or ``batch_items`` (or fewer, at the end) items
    merged: ``Batch.cat`` when all are batches, else a list."""
    if batch_items == 1:
        return items[0]
    batch_module = sys.modules.get("mcore_rl.data.batch")  # loaded if any item is a Batch
    if batch_module is not None and all(isinstance(i, batch_module.Batch) for i in items):
        return batch_module.Batch.cat(items)
    return list(items)


def lead_process_group() -> None:
    """Make this process the leader of a process group of its own (Ray's workers already
    are; the check keeps `kill_group` from ever hitting a group it does not lead)."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (or only ``pid``, if it leads none)."""
    try:
        if os.getpgid(pid) == pid and pid != os.getpgid(0):
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:  # the leader is gone; its group may still have members
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ControllerProcess:
    """The actor behind one controller instance."""

    def __init__(self, spec: InstanceSpec, hub: Any = None):
        self.spec = spec
        self.executor: Executor | None = None
        lead_process_group()
        services.set_hub(hub)

    def where(self) -> tuple[str, int]:
        """(node id, pid) of this process."""
        return ray_shim.node_id(), os.getpid()

    def setup(self) -> list[tuple[str, int]]:
        """Build the function through the strategy; the processes the strategy started."""
        self.executor = resolve_strategy(self.spec.strategy)(self.spec)
        return self.executor.processes()

    def run(self, hub: Any) -> ControllerStats:
        """Move items until the input ends (or the launch is cancelled); the stats."""
        ray = ray_shim.require()
        spec = self.spec
        stats = ControllerStats(spec.role, spec.index)
        start = time.perf_counter()
        results = self._streamed(hub, stats) if spec.streaming else self._called(hub, stats)
        for result in results:
            items = len(unpack(result)) if result is not None else 0
            if not items or spec.output is None:
                continue
            put = hub.put.remote(spec.output, [ray.put(result)])
            if not self._acknowledged(put, items, stats):
                break
        if spec.output is not None:
            ray.get(hub.close.remote(spec.output))
        stats.wall_s = time.perf_counter() - start
        if spec.streaming:  # the function's own time: what was not spent waiting on streams
            stats.busy_s = max(0.0, stats.wall_s - stats.blocked_in_s - stats.blocked_out_s)
        return stats

    @staticmethod
    def _acknowledged(put: Any, items: int, stats: ControllerStats) -> bool:
        """Wait for a put of ``items`` items into the output stream (a full stream holds it
        back); whether the stream took them (False once the launch is cancelled)."""
        t = time.perf_counter()
        accepted = ray_shim.require().get(put)
        stats.blocked_out_s += time.perf_counter() - t
        stats.items_out += items if accepted else 0
        stats.puts += int(accepted)
        return accepted

    def _called(self, hub: Any, stats: ControllerStats) -> Iterator[Any]:
        """The function called per (merged) input item; its results (a function may return
        `Many` items, or None for none). The results of the calls on one entry's items go on
        together, as one entry."""
        ray = ray_shim.require()
        spec = self.spec
        together: list = []
        for count, item, entry_done in self._inputs(hub, stats):
            if spec.counts_steps and not ray.get(hub.take_step.remote()):
                break
            result = self._call(item, hub, stats)
            if spec.reports_done:
                ray.get(hub.sink_done.remote(count))
            if result is not None and spec.output is not None:
                together += unpack(result)
            if entry_done and together:
                yield pack(together)
                together = []
        if together:  # the launch stopped within an entry
            yield pack(together)

    def _streamed(self, hub: Any, stats: ControllerStats) -> Iterator[Any]:
        """The streaming function, given the input iterator; what it yields."""
        def inputs() -> Iterator[Any]:
            for _, item, _ in self._inputs(hub, stats):
                stats.calls += 1
                yield item

        yield from self.executor.stream(inputs())

    def close(self) -> None:
        """Close the function (and its strategy's processes). The launch calls it once every
        instance has finished, so what one published stays usable to the last consumer."""
        if self.executor is not None:
            self.executor.close()

    def serve(self, name: str, attr: str, args: tuple | None, kwargs: dict | None) -> Any:
        """A call on an object this process published (`mcore_rl.flow.publish`)."""
        return services.serve(name, attr, args, kwargs)

    def kill_group(self) -> None:
        """Kill this process, what it started and the strategy's processes on this node."""
        here = ray_shim.node_id()
        for node, pid in self.executor.processes() if self.executor else []:
            if node == here:
                kill_process_group(pid)
        os.killpg(os.getpid(), signal.SIGKILL)

    def _inputs(self, hub: Any, stats: ControllerStats) -> Iterator[tuple[int, Any, bool]]:
        """(how many stream items, the call's input, whether the next call must wait for
        the stream: the results so far should go on) until the input stream ends. An entry
        of several items (`Many`) is taken apart: its items may go to different calls; a
        call on items taken earlier first makes sure the launch has not been cancelled."""
        ray = ray_shim.require()
        k = self.spec.batch_items
        group: list = []
        taken: list = []  # items of the entries taken, not yet in a call's input
        state, fetched = OPEN, False
        while True:
            if not taken:
                if state != OPEN:
                    break
                t = time.perf_counter()
                boxes, state = ray.get(hub.get.remote(self.spec.input, k - len(group)))
                values = ray.get([box[0] for box in boxes]) if boxes else []
                stats.blocked_in_s += time.perf_counter() - t
                taken = [item for value in values for item in unpack(value)]
                stats.items_in += len(taken)
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

    def _call(self, item: Any, hub: Any, stats: ControllerStats) -> Any:
        ray = ray_shim.require()
        devices = self.spec.devices
        if self.spec.takes_turns:
            t = time.perf_counter()
            ray.get(hub.acquire.remote(devices))
            stats.turn_wait_s += time.perf_counter() - t
        t = time.perf_counter()
        result = self.executor(item)
        stats.busy_s += time.perf_counter() - t
        stats.calls += 1
        if self.spec.takes_turns:
            ray.get(hub.release.remote(devices))
        return result
