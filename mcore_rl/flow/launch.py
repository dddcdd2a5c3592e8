"""`launch`: start a `ControllerGroup` on Ray, feed it, wait for it, tear it all down.

Every controller instance is an actor (`ControllerProcess`) that reserves no CPU of Ray's
(devices are pinned by the process itself); the streams live in one `Hub` actor. The
driver feeds the launch's ``data`` from a thread and waits on every instance at once, so
the first failure, a raised exception or a dead process, ends the launch at once: every
actor is killed with the processes it started, and `FlowError` names the instance."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable

from mcore_rl.errors import UsageError
from mcore_rl.flow import ray_shim
from mcore_rl.flow.controller import ControllerProcess, kill_process_group
from mcore_rl.flow.entries import pack
from mcore_rl.flow.graph import ControllerGroup
from mcore_rl.flow.hub import Hub
from mcore_rl.flow.plan import FEED, InstanceSpec, Plan, build_plan
from mcore_rl.flow.stats import FlowStats
from mcore_rl.flow.strategies import STRATEGIES

POLL_S = 0.2
"""How often the driver looks at the data feeder while it waits on the controllers."""
KILL_WAIT_S = 2.0
"""At most this long for Ray's kill of the actors before their process groups are killed."""


class FlowError(RuntimeError):
    """A controller instance failed: its function raised, or its process died. The first
    line names the role, the instance and the original exception; the remote traceback
    follows."""

    def __init__(self, message: str, role: str | None = None, index: int | None = None,
                 cause_type: str | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.role, self.index, self.cause_type = role, index, cause_type
        self.cause = cause
        """The original exception (through calls into other controllers' objects too), when
        it could be carried back; None when a process died."""


def launch(group: ControllerGroup, data: Iterable[Any] | None = None, *,
           num_epochs: int | None = None, steps: int | None = None,
           address: str | None = None, feed_buffer: int | None = None,
           max_in_flight: int | None = None) -> FlowStats:
    """Run ``group`` to the end and return its stats.

    ``data`` feeds the source controllers (no ``data_input``), each item to one source
    instance, ``num_epochs`` times over (default 1; a one-shot iterator is read once).
    ``steps`` stops the launch after that many calls of the sink controllers (no
    ``data_output``); with ``steps`` and no ``num_epochs`` the data repeats until then.
    Ray: joins the running one, else ``ray.init(address=address)`` (a local cluster when
    None), shut down again at the end. ``feed_buffer``: items of ``data`` waiting for the
    sources (default two per source). ``max_in_flight``: at most this many items of
    ``data`` are fed and not yet finished by the sinks (a sink call finishes the items it
    merged, ``batch_items``): 1 runs the graph one item at a time (a synchronous RL step),
    K lets the sources run K - 1 items ahead."""
    ray = ray_shim.require()
    if steps is None and num_epochs is None:
        num_epochs = 1
    if num_epochs is not None and num_epochs < 1:
        raise UsageError(f"num_epochs must be >= 1, got {num_epochs}")
    if data is not None and iter(data) is data and num_epochs not in (None, 1):
        raise UsageError(f"num_epochs={num_epochs} reads data again, but it is a one-shot "
                         "iterator: give a list or another re-iterable")
    plan = build_plan(group, data is not None, steps, feed_buffer, max_in_flight)
    for spec in plan.instances:
        if isinstance(spec.strategy, str):
            STRATEGIES.entry(spec.strategy)  # an unknown name fails here, before Ray starts
    if ray.is_initialized():
        return _Launch(plan, steps, max_in_flight).execute(data, num_epochs)
    with ray_shim.local_ray(address=address, include_dashboard=False):
        return _Launch(plan, steps, max_in_flight).execute(data, num_epochs)


def feed_entry_items(max_in_flight: int | None, sources: int) -> int:
    """Items per entry of the feed: one without ``max_in_flight``; with it, half the
    window spread over the sources (an entry goes to one source instance), so a launch
    that admits many items at once (the asynchronous schedule: a step's prompt groups)
    puts a few entries instead of an entry per item."""
    if max_in_flight is None:
        return 1
    return max(1, max_in_flight // (2 * max(1, sources)))


class _Launch:
    """The actors of one launch and the driver's side of it."""

    def __init__(self, plan: Plan, steps: int | None, max_in_flight: int | None = None):
        self.ray = ray_shim.require()
        self.plan, self.steps, self.max_in_flight = plan, steps, max_in_flight
        self.hub: Any = None
        self.actors: list = []
        self.processes: list[tuple[str, int]] = []
        """(node id, pid) of every process started, for the teardown."""
        self.stopping = threading.Event()
        self.feed_error: BaseException | None = None
        self.feeder: threading.Thread | None = None

    def execute(self, data: Iterable[Any] | None, num_epochs: int | None) -> FlowStats:
        start = time.perf_counter()
        try:
            self.hub = ray_shim.actor_class(Hub).options(num_cpus=0).remote(
                self.plan.streams, self.steps)
            controller = ray_shim.actor_class(ControllerProcess)
            self.actors = [controller.options(num_cpus=0, max_concurrency=4).remote(spec, self.hub)
                           for spec in self.plan.instances]
            self.processes += self._wait_all("where")
            self.processes += [p for ps in self._wait_all("setup") for p in ps]
            if data is not None:
                self.feeder = threading.Thread(target=self._feed, args=(data, num_epochs),
                                               daemon=True, name="flow-feeder")
                self.feeder.start()
            stats = self._wait_all("run", self.hub)
            self._wait_all("close")
        finally:
            self._teardown()
        sinks = {s.role for s in self.plan.instances if s.output is None}
        return FlowStats.collect(stats, sinks, time.perf_counter() - start)

    def _wait_all(self, method: str, *args: Any) -> list:
        """``method`` called on every instance; the results in instance order, or the
        first failure (or a failure of the data feeder) as a `FlowError`."""
        ray = self.ray
        refs = {getattr(a, method).remote(*args): i for i, a in enumerate(self.actors)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S, fetch_local=False)
            if self.feed_error is not None:
                raise FlowError(f"the launch's data failed: {_describe(self.feed_error)}") \
                    from self.feed_error
            for ref in ready:
                spec = self.plan.instances[refs[ref]]
                try:
                    results[refs[ref]] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - every failure names its instance
                    raise _failure(spec, method, err) from None
        return [results[i] for i in range(len(self.actors))]

    def _feed(self, data: Iterable[Any], num_epochs: int | None) -> None:
        """Put ``data`` into the sources' stream, at most ``max_in_flight`` items ahead of
        the sinks. Items admitted at the same moment go in together, up to
        `feed_entry_items` per entry (`Many`: one put, one call for all of them); an
        admitted item waits for the next ones of its entry, so ``data`` should give them
        without waiting (a list, a generator over records in memory)."""
        ray = self.ray
        try:
            epoch, one_shot, total, chunk = 0, iter(data) is data, 0, []
            admitted = self.max_in_flight  # items the launch may have fed so far
            per_entry = feed_entry_items(self.max_in_flight,
                                         sum(s.input == FEED for s in self.plan.instances))

            def put(items: list) -> bool:
                nonlocal total
                if self.stopping.is_set() or \
                        not ray.get(self.hub.put.remote(FEED, [ray.put(pack(items))])):
                    return False
                total += len(items)
                items.clear()
                return True

            while num_epochs is None or epoch < num_epochs:
                fed = 0
                for item in data:
                    if admitted is not None and total + len(chunk) >= admitted:
                        if chunk and not put(chunk):
                            return
                        done = ray.get(self.hub.wait_done.remote(total - self.max_in_flight + 1))
                        if done is None:
                            return
                        admitted = done + self.max_in_flight
                    chunk.append(item)
                    fed += 1
                    if len(chunk) >= per_entry and not put(chunk):
                        return
                if chunk and not put(chunk):
                    return
                epoch += 1
                if one_shot or not fed:
                    break
            ray.get(self.hub.close.remote(FEED))
        except BaseException as err:  # noqa: BLE001 - reported by the waiting driver
            if not self.stopping.is_set():
                self.feed_error = err

    def _teardown(self) -> None:
        """Kill every actor and, on this node, every process group they lead; actors on
        other nodes kill their own groups first."""
        ray = self.ray
        self.stopping.set()
        here = ray_shim.node_id()
        remote = {node for node, _ in self.processes if node != here}
        if remote:
            kills = [a.kill_group.remote() for a in self.actors]
            ray.wait(kills, num_returns=len(kills), timeout=2.0)
        for actor in [*self.actors, *([self.hub] if self.hub is not None else [])]:
            ray.kill(actor, no_restart=True)
        local = [pid for node, pid in self.processes if node == here]
        deadline = time.monotonic() + KILL_WAIT_S  # Ray's own kill first: it logs no error
        while any(_alive(pid) for pid in local) and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in local:  # then what they started (and any process that outlived the kill)
            kill_process_group(pid)
        if self.feeder is not None:
            self.feeder.join(timeout=5.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _failure(spec: InstanceSpec, method: str, err: Exception) -> FlowError:
    """The `FlowError` for ``spec`` from what ``ray.get`` of its ``method`` raised."""
    exceptions = ray_shim.require().exceptions
    phase = {"where": "starting", "setup": "setting up", "run": "running",
             "close": "closing"}[method]
    original = None
    if isinstance(err, exceptions.RayTaskError):
        cause = err
        while isinstance(cause, exceptions.RayTaskError) and isinstance(
                getattr(cause, "cause", None), BaseException):
            cause = cause.cause  # a call into another actor's object nests its error
        if isinstance(cause, exceptions.RayActorError):  # it lost the hub or a worker
            what = f"a process it depends on died ({type(cause).__name__})"
        else:
            what, original = _describe(cause), cause
        cause_type = type(cause).__name__
        detail = str(err)
    elif isinstance(err, exceptions.RayActorError):
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if getattr(err, "actor_init_failed", False) and lines:  # e.g. unpicklable function
            what = lines[-1]
        else:
            what = f"its process died ({type(err).__name__})"
        cause_type, detail = type(err).__name__, str(err)
    else:
        what, cause_type, detail = _describe(err), type(err).__name__, ""
    message = f"controller {spec.name} failed while {phase}: {what}"
    return FlowError(f"{message}\n{detail}" if detail else message, spec.role, spec.index,
                     cause_type, original)
