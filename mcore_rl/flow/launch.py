"""`launch`: start a `ControllerGroup` on Ray, feed it, wait for it, tear it all down; and
`start`: the same graph started for a driver that calls its controllers itself
(`RunningGraph.call`, how `mcore_rl.RLTrainer` drives its roles).

Every controller instance is an actor (`ControllerProcess`); the streams live in one `Hub`
actor. On CPU an actor reserves no CPU of Ray's (devices are cores, pinned by the process
itself). Controllers whose devices are `GPUs` get bundles of Ray placement groups
(`device_plan`, `gpu_placement`), checked against the cluster's GPUs before any group is
created. The driver feeds the launch's ``data`` from a thread (sources with data of their
own read it themselves) and waits on every instance at once, so the first failure, a raised
exception or a dead process, ends the launch at once: every actor is killed with the
processes it started, and `FlowError` names the instance."""
from __future__ import annotations

import re
import sys
import threading
import time
from typing import Any, Callable, Iterable

from mcore_rl.errors import UsageError
from mcore_rl.flow import ray_shim
from mcore_rl.flow.controller import ControllerProcess
from mcore_rl.flow.entries import pack
from mcore_rl.flow.graph import ControllerGroup
from mcore_rl.flow.hub import Hub
from mcore_rl.flow.plan import FEED, InstanceSpec, Plan, build_plan
from mcore_rl.flow.processes import alive, kill_process_group
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
                 cause_type: str | None = None, cause: BaseException | None = None,
                 dependency: bool = False):
        super().__init__(message)
        self.role, self.index, self.cause_type = role, index, cause_type
        self.cause = cause
        """The original exception (through calls into other controllers' objects too), when
        it could be carried back; None when a process died."""
        self.dependency = dependency
        """It failed because a process it depends on died (the hub, a rank, another
        controller whose object it called), not by itself."""


def launch(group: ControllerGroup, num_epochs: int | None = None, data: Iterable[Any] | None = None,
           *, steps: int | None = None, address: str | None = None,
           feed_buffer: int | None = None, max_in_flight: int | None = None,
           on_started: Callable[[dict[str, list[int]]], None] | None = None) -> FlowStats:
    """Run ``group`` to the end and return its stats.

    ``launch(group, num_epochs)``: the sources read their own ``data`` (`Controller.data`)
    that many times (default 1). ``data`` feeds the sources that have none, each item to
    one source instance. ``steps`` stops the launch after that many calls of the sink
    controllers (no ``data_output``); with ``steps`` and no ``num_epochs`` the data repeats
    until then. Ray: joins the running one, else ``ray.init(address=address)`` (a local
    cluster when None), shut down again at the end. ``feed_buffer``: items of ``data``
    waiting for the sources (default two per source). ``max_in_flight``: at most this many
    items are read (or fed) and not yet finished by the sinks (a sink call finishes the
    items it merged, ``batch_items``): 1 runs the graph one item at a time (a synchronous
    RL step), K lets the sources run K - 1 items ahead."""
    ray = ray_shim.require()
    if num_epochs is not None and (isinstance(num_epochs, bool) or not isinstance(num_epochs, int)):
        raise UsageError(f"launch(group, num_epochs): num_epochs must be an int, got "
                         f"{type(num_epochs).__name__}; give data to feed as data=")
    if steps is None and num_epochs is None:
        num_epochs = 1
    if num_epochs is not None and num_epochs < 1:
        raise UsageError(f"num_epochs must be >= 1, got {num_epochs}")
    if data is not None and iter(data) is data and num_epochs not in (None, 1):
        raise UsageError(f"num_epochs={num_epochs} reads data again, but it is a one-shot "
                         "iterator: give a list or another re-iterable")
    plan = build_plan(group, data is not None, steps, feed_buffer, max_in_flight)
    _check_strategies(plan)
    if ray.is_initialized():
        return _Launch(plan, steps, max_in_flight).execute(data, num_epochs, on_started)
    with ray_shim.local_ray(address=address, include_dashboard=False):
        return _Launch(plan, steps, max_in_flight).execute(data, num_epochs, on_started)


def start(group: ControllerGroup) -> "RunningGraph":
    """Start ``group``'s controllers (Ray must be running) for a driver that calls them
    (`RunningGraph.call`) instead of streaming data through them; `RunningGraph.close`
    ends them."""
    plan = build_plan(group, False, None, driven=True)
    _check_strategies(plan)
    running = _Launch(plan, None)
    try:
        running.start_actors()
    except BaseException:
        running.teardown()
        raise
    return RunningGraph(running)


def _check_strategies(plan: Plan) -> None:
    for spec in plan.instances:
        if isinstance(spec.strategy, str):
            STRATEGIES.entry(spec.strategy)  # an unknown name fails here, before Ray starts


def feed_entry_items(max_in_flight: int | None, sources: int) -> int:
    """Items per entry of the feed: one without ``max_in_flight``; with it, half the
    window spread over the sources (an entry goes to one source instance), so a launch
    that admits many items at once (the asynchronous schedule: a step's prompt groups)
    puts a few entries instead of an entry per item."""
    if max_in_flight is None:
        return 1
    return max(1, max_in_flight // (2 * max(1, sources)))


class RunningGraph:
    """A started graph, driven call by call (`start`)."""

    def __init__(self, launch: "_Launch"):
        self._launch = launch

    def call(self, role: str, method: str = "__call__", *args: Any, index: int = 0, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` of ``role``'s function (instance ``index``), wherever it
        runs (every rank of a worker group: rank 0's answer); a failure is a `FlowError`."""
        launch = self._launch
        for i, spec in enumerate(launch.plan.instances):
            if spec.index == index and role in spec.roles:
                stage = None if role == spec.role else role
                ref = launch.actors[i].invoke.remote(method, args, kwargs, stage)
                return launch.wait_one(i, ref, "running")
        raise UsageError(f"the graph has no controller '{role}' #{index}")

    def processes(self, role: str | None = None) -> list[tuple[str, int]]:
        """(node id, pid) of the processes started (of ``role``'s instances only)."""
        return [p for spec, ps in zip(self._launch.plan.instances, self._launch.places)
                if role is None or role in spec.roles for p in ps]

    def close(self) -> None:
        """Close every function (the engine, the run's summary), then end the processes."""
        launch, self._launch = self._launch, None
        if launch is None:
            return
        try:
            launch.wait_all("close")
        finally:
            launch.teardown()

    def kill(self) -> None:
        """End every process now (after a failure: a broken world cannot close in order)."""
        launch, self._launch = self._launch, None
        if launch is not None:
            launch.teardown()

    @property
    def closed(self) -> bool:
        return self._launch is None


class _Launch:
    """The actors of one launch and the driver's side of it."""

    def __init__(self, plan: Plan, steps: int | None, max_in_flight: int | None = None):
        self.ray = ray_shim.require()
        self.plan, self.steps, self.max_in_flight = plan, steps, max_in_flight
        self.hub: Any = None
        self.hub_pid: int | None = None
        self.actors: list = []
        self.reservation: Any = None
        self.places: list[list[tuple[str, int]]] = []
        """(node id, pid) of every process of each instance, for the teardown."""
        self.lost: set[int] = set()
        """Instances that failed and were replaced by the others of their role."""
        self.requeued = 0
        """Items the lost instances had taken and not finished, fed again."""
        self.stopping = threading.Event()
        self.feed_error: BaseException | None = None
        self.feeder: threading.Thread | None = None

    @property
    def processes(self) -> list[tuple[str, int]]:
        return [p for ps in self.places for p in ps]

    def process_map(self) -> dict[str, list[int]]:
        """Which process is which: ``{"hub": [pid], "<role>#<index>": [the controller's pid,
        then those it started (a worker group's ranks in rank order)]}``."""
        out = {"hub": [self.hub_pid]} if self.hub_pid is not None else {}
        for spec, places in zip(self.plan.instances, self.places):
            out[f"{spec.role}#{spec.index}"] = [pid for _, pid in places]
        return out

    def _names(self) -> dict[int, str]:
        """pid -> how a failure names that process."""
        names = {self.hub_pid: "the stream hub"} if self.hub_pid is not None else {}
        for spec, places in zip(self.plan.instances, self.places):
            pids = [pid for _, pid in places]
            if pids:
                names[pids[0]] = f"controller {spec.name}"
            for rank, pid in enumerate(pids[1:]):
                names[pid] = f"rank {rank} of controller {spec.name}"
        return names

    def execute(self, data: Iterable[Any] | None, num_epochs: int | None,
                on_started: Callable[[dict[str, list[int]]], None] | None = None) -> FlowStats:
        start = time.perf_counter()
        try:
            self.start_actors()
            if on_started is not None:
                on_started(self.process_map())
            if data is not None:
                self.feeder = threading.Thread(target=self._feed, args=(data, num_epochs),
                                               daemon=True, name="flow-feeder")
                self.feeder.start()
            stats = [s for part in self.wait_all("run", self.hub, num_epochs) for s in part]
            self.wait_all("close")
        finally:
            self.teardown()
        sinks = {s.role for s in self.plan.instances if s.output is None}
        result = FlowStats.collect(stats, sinks, time.perf_counter() - start)
        result.lost = [self.plan.instances[i].name for i in sorted(self.lost)]
        result.requeued = self.requeued
        return result

    def start_actors(self) -> None:
        """The hub, every instance's actor (in its GPU bundle, if any), its function built."""
        from mcore_rl.flow.graph import GPUs

        self.hub = ray_shim.actor_class(Hub).options(num_cpus=0).remote(
            self.plan.streams, self.steps)
        placed = self._reserve_gpus() if any(isinstance(s.devices, GPUs)
                                             for s in self.plan.instances) else {}
        controller = ray_shim.actor_class(ControllerProcess)
        for i, spec in enumerate(self.plan.instances):
            options, placements, more = placed.get(i, ({"num_cpus": 0}, None, None))
            self.actors.append(controller.options(max_concurrency=4, **options).remote(
                spec, self.hub, placements, more))
        self.places = [[place] for place in self.wait_all("where")]
        self.hub_pid = self.wait_hub(self.hub.pid.remote())
        for mine, started in zip(self.places, self.wait_all("setup")):
            mine += started

    def wait_hub(self, ref: Any) -> Any:
        """``ray.get`` of a call of the hub, its death as a `FlowError`."""
        try:
            return self.ray.get(ref)
        except Exception as err:  # noqa: BLE001 - Ray raises several kinds
            raise FlowError(f"the stream hub failed: {_describe(err)}", "hub", 0,
                            type(err).__name__) from None

    def _reserve_gpus(self) -> dict[int, tuple[dict, list[dict] | None, list[dict] | None]]:
        """Placement groups for the instances with `GPUs`: per instance, the options of its
        controller's actor, of each rank (a worker group, even of one rank) and of its
        further bundles (a process of several GPUs: an engine whose workers it starts)."""
        from mcore_rl.flow import gpu_placement
        from mcore_rl.flow.device_plan import plan_devices

        slots = plan_devices(gpu_placement.demands_of(self.plan.instances),
                             gpu_placement.cluster_nodes())
        self.reservation = gpu_placement.Reservation.make(slots)
        out = {}
        for i, spec in enumerate(self.plan.instances):
            mine = gpu_placement.slots_of(slots, spec.role, spec.index)
            if not mine:
                continue
            if gpu_placement.runs_ranks(spec):  # the ranks take the bundles; the controller none
                out[i] = ({"num_cpus": 0}, [self.reservation.options(s) for s in mine], None)
            else:  # the process in its first bundle, the GPUs of the others made visible to it
                out[i] = (self.reservation.options(mine[0], capture_child_tasks=True), None,
                          [self.reservation.options(s) for s in mine[1:]] or None)
        return out

    def wait_one(self, i: int, ref: Any, phase: str) -> Any:
        """``ray.get`` of one instance's call, its failure as a `FlowError`."""
        try:
            return ray_shim.get_all([ref])[0]
        except Exception as err:  # noqa: BLE001 - every failure names its instance
            raise _failure(self.plan.instances[i], phase, err, self._names()) from None

    def wait_all(self, method: str, *args: Any) -> list:
        """``method`` called on every instance; the results in instance order, or the
        first failure (or a failure of the data feeder) as a `FlowError`."""
        ray = self.ray
        refs = {getattr(a, method).remote(*args): i for i, a in enumerate(self.actors)
                if i not in self.lost}
        results: dict[int, Any] = {i: [] for i in self.lost}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S, fetch_local=False)
            if self.feed_error is not None:
                err = self.feed_error
                dead = _dead(err, self._names()) if isinstance(
                    err, ray.exceptions.RayActorError) else ""
                what = f"{dead} died ({type(err).__name__})" if dead else _describe(err)
                raise FlowError(f"the launch's data failed: {what}", dependency=bool(dead)) \
                    from err
            for ref in ready:
                spec = self.plan.instances[refs[ref]]
                try:
                    results[refs[ref]] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - every failure names its instance
                    failure = _failure(spec, _PHASES[method], err, self._names())
                    if method != "run" or not self.replace(refs[ref], failure):
                        raise failure from None
                    results[refs[ref]] = []
        return [results[i] for i in range(len(self.actors))]

    def replace(self, i: int, failure: FlowError) -> bool:
        """Instance ``i`` failed while running: when its role is `Replaceable` and another
        instance of it is alive, end its processes, give what it had not finished back to
        the feed and go on (True); else False (the launch fails, naming the last one)."""
        spec = self.plan.instances[i]
        if spec.replaceable is None or failure.dependency:  # e.g. the hub died: not its fault
            return False
        peers = [j for j, s in enumerate(self.plan.instances) if s.role == spec.role]
        alive = [j for j in peers if j != i and j not in self.lost]
        first = str(failure).splitlines()[0]
        if not alive:
            if len(peers) > 1:
                failure.args = (f"{first}; no other instance of '{spec.role}' is left"
                                + str(failure)[len(first):],)
            return False
        self.lost.add(i)
        print(f"mcore-rl: {first}; going on with {len(alive)} of {len(peers)} '{spec.role}' "
              "instances", file=sys.stderr, flush=True)
        self.kill([i])
        requeued = self.wait_hub(self.hub.requeue.remote(spec.input, spec.name))
        if spec.output is not None:  # it will not (a close it made already counts once)
            self.wait_hub(self.hub.close.remote(spec.output, spec.name))
        self.requeued += requeued
        return True

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
            keyed = next((s.replaceable for s in self.plan.instances
                          if s.input == FEED and s.replaceable is not None), None)
            per_entry = 1 if keyed is not None else feed_entry_items(
                self.max_in_flight, sum(s.input == FEED for s in self.plan.instances))

            def put(items: list) -> bool:
                nonlocal total
                key = keyed.item_key(items[0]) if keyed is not None else None  # one item each
                if self.stopping.is_set() or \
                        not ray.get(self.hub.put.remote(FEED, [ray.put(pack(items))], key)):
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

    def kill(self, instances: list[int], hub: bool = False) -> None:
        """Kill the actors of ``instances`` (and the hub's) and, on this node, every process
        group their processes lead; actors on other nodes kill their own groups first."""
        ray, here = self.ray, ray_shim.node_id()
        places = [place for i in instances for place in self.places[i]] \
            if len(self.places) == len(self.actors) else []
        if any(node != here for node, _ in places):
            kills = [self.actors[i].kill_group.remote() for i in instances]
            ray.wait(kills, num_returns=len(kills), timeout=2.0)
        for actor in [*(self.actors[i] for i in instances), *([self.hub] if hub and self.hub
                                                               is not None else [])]:
            ray.kill(actor, no_restart=True)
        local = [pid for node, pid in places if node == here]
        deadline = time.monotonic() + KILL_WAIT_S  # Ray's own kill first: it logs no error
        while any(alive(pid) for pid in local) and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in local:  # then what they started (and any process that outlived the kill)
            kill_process_group(pid)

    def teardown(self) -> None:
        """Kill every actor and the process groups they lead (`kill`); the placement groups
        go last."""
        self.stopping.set()
        # a lost instance's processes were killed then: their pids may be reused by now
        self.kill([i for i in range(len(self.actors)) if i not in self.lost], hub=True)
        if self.feeder is not None:
            self.feeder.join(timeout=5.0)
        if self.reservation is not None:
            self.reservation.release()


_PHASES = {"where": "starting", "setup": "setting up", "run": "running", "close": "closing",
           "invoke": "running"}


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


_PID = re.compile(r"^\s*pid: (\d+)\s*$", re.MULTILINE)


def _pid_of(err: BaseException) -> int | None:
    """The pid of the process a Ray actor error says died, if it names one."""
    found = _PID.search(str(err))
    return int(found.group(1)) if found else None


def _dead(err: BaseException, names: dict[int, str]) -> str:
    """Which process a Ray actor error says died: its name in the launch and pid
    (``names``), or its pid alone; empty when the error names none."""
    pid = _pid_of(err)
    if pid is None:
        return ""
    return f"{names[pid]} (pid {pid})" if pid in names else f"process {pid}"


def _failure(spec: InstanceSpec, phase: str, err: Exception,
             names: dict[int, str] | None = None) -> FlowError:
    """The `FlowError` for ``spec`` from what ``ray.get`` of one of its calls raised;
    ``names`` (pid -> name) names a process it depended on that died."""
    names = names or {}
    exceptions = ray_shim.require().exceptions
    original, dependency = None, False
    if isinstance(err, exceptions.RayTaskError):
        cause = err
        while isinstance(cause, exceptions.RayTaskError) and isinstance(
                getattr(cause, "cause", None), BaseException):
            cause = cause.cause  # a call into another actor's object nests its error
        dependency = isinstance(cause, exceptions.RayActorError)
        if dependency:  # it lost the hub or a worker
            dead = _dead(cause, names)
            what = (f"{dead} died" if dead else "a process it depends on died") + \
                f" ({type(cause).__name__})"
        else:
            what, original = _describe(cause), cause
        cause_type = type(cause).__name__
        detail = str(err)
    elif isinstance(err, exceptions.RayActorError):
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if getattr(err, "actor_init_failed", False) and lines:  # e.g. unpicklable function
            what = lines[-1]
        else:
            pid = _pid_of(err)
            what = f"its process{f' (pid {pid})' if pid else ''} died ({type(err).__name__})"
        cause_type, detail = type(err).__name__, str(err)
    else:
        what, cause_type, detail = _describe(err), type(err).__name__, ""
    message = f"controller {spec.name} failed while {phase}: {what}"
    return FlowError(f"{message}\n{detail}" if detail else message, spec.role, spec.index,
                     cause_type, original, dependency)
