"""The ``worker_group`` strategy: a controller's function run SPMD by ``num_workers``
processes that form one torch.distributed world (gloo on CPU, NCCL on GPU).

Each rank is a Ray actor, pinned to its share of the controller's cores on CPU, or placed
in a bundle of a placement group with a GPU of its own (`mcore_rl.flow.gpu_placement`),
which it binds before the world starts. The function is built on every rank; the
controllers fused into this one are built on rank 0, first (what they publish is there
when the function looks it up). In a launch, rank 0 runs the controller's item loop
(`mcore_rl.flow.item_loop`): it takes each item from the stream, runs the fused stages,
and hands the call's input to the other ranks over their world (`follow`), so a batch
reaches the ranks without passing through another process. A driver may also call any
method of the function's object on every rank at once (`WorkerGroup.invoke`): that is how
`mcore_rl.RLTrainer` drives its ranks. On a CPU cluster of several nodes the ranks fill the
nodes evenly, rank 0 on the caller's node (`cluster.rank_nodes`)."""
from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta
from typing import Any, Callable

from mcore_rl.flow import ray_shim, round_trips, services
from mcore_rl.flow.cluster import rank_nodes
from mcore_rl.flow.graph import build_function
from mcore_rl.flow.item_loop import ItemLoop, Stage, close_all
from mcore_rl.flow.placement import pin_to_cores, split_devices
from mcore_rl.flow.processes import kill_process_group, lead_process_group
from mcore_rl.process_exit import end_after_exit_handlers

STORE_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits on the world's store (joining, and every collective's setup)."""

EXIT_WAIT_S = 5.0
"""How long closing a worker group waits for its ranks' orderly exit (a fraction of a
second: `end_after_exit_handlers`)."""

RankSetup = Callable[[int, int], None]
"""Run on every rank after it joined the world, before the function is built: ``(rank,
world_size)``; e.g. the Megatron strategy's model-parallel state. It may have an
``outside()`` context manager: what fused (non-SPMD) stages run inside."""

END = "<end of the loop>"
"""What rank 0 hands the other ranks when its item loop has ended."""
FAILED = "<rank 0 failed>"
"""What rank 0 hands the other ranks when its loop failed while they waited for an item."""


class LeaderFailed(RuntimeError):
    """On a rank other than 0: rank 0's loop failed (its error is its own to report)."""


class RankRuntime:
    """What a rank holds and runs, in whatever process hosts it (a Ray actor, or a rank of a
    world started otherwise: `mcore_rl.flow.in_world`)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.function: Any = None
        self.stages: list[Stage] = []
        self.setup: Any = None

    def build(self, function: Any, setup: RankSetup | None, world_size: int,
              stages: tuple = ()) -> None:
        """After the world started: ``setup``, the fused stages (rank 0), the function."""
        if setup is not None:
            setup(self.rank, world_size)
        self.setup = setup
        if self.rank == 0:
            with self.outside():
                self.stages = [Stage(s.role, 0, build_function(s.function), self.outside)
                               for s in stages]
        self.function = build_function(function)

    def outside(self):
        """The context fused stages run in (outside Megatron's CPU layer, for instance)."""
        outside = getattr(self.setup, "outside", None)
        return outside() if callable(outside) else contextlib.nullcontext()

    def invoke(self, method: str, args: tuple, kwargs: dict, role: str | None = None) -> Any:
        """``method(*args, **kwargs)`` of the function's object, or (``role``, rank 0) of a
        fused stage's."""
        if role is None:
            return getattr(self.function, method)(*args, **kwargs)
        stage = next(s for s in self.stages if s.stats.role == role)
        with self.outside():
            return getattr(stage.function, method)(*args, **kwargs)

    def run_loop(self, spec: Any, hub: Any, num_epochs: int | None, tell_failure: bool = False):
        """The controller's item loop on rank 0 (its stats), `follow` on the others.
        ``tell_failure``: when rank 0's loop fails while the others wait for an item (a fused
        stage, the stream), they end too (`LeaderFailed`): in a world no launch kills (one
        started by torchrun or srun); a launch kills the group itself."""
        if self.rank != 0:
            follow(self.function)
            return None
        self._in_call = False
        try:
            stats = ItemLoop(spec, hub, self._lead, stages=self.stages).run(num_epochs)
        except BaseException:
            # Not after a failure inside the function: the others are in its collectives.
            if tell_failure and not self._in_call:
                handoff(FAILED)
            raise
        handoff(END)
        return stats

    def _lead(self, item: Any) -> Any:
        """Rank 0's call: the item to every rank, then the function here."""
        handoff(item)
        self._in_call = True
        result = self.function(item)
        self._in_call = False
        return result

    def close(self) -> None:
        close_all(self.stages, self.function)


class RankProcess:
    """One rank of a worker group (a Ray actor)."""

    def __init__(self, rank: int, world_size: int, devices: tuple[int, ...] | None,
                 threads: int | None = None, env: dict[str, str] | None = None,
                 hub: Any = None, gpu: bool = False):
        lead_process_group()
        services.set_hub(hub)
        os.environ.update(env or {})
        self.rank, self.world_size = rank, world_size
        self.local_device: int | None = None
        if gpu:  # the GPU of its bundle, bound before the world starts (NCCL binds it)
            from mcore_rl.flow.gpu_placement import bind_gpu

            self.local_device = bind_gpu()
        pin_to_cores(devices)
        if threads is not None and not devices:
            import torch

            torch.set_num_threads(threads)
        self.runtime = RankRuntime(rank)
        self._store: Any = None

    def where(self) -> tuple[str, int]:
        return ray_shim.node_id(), os.getpid()

    def rendezvous(self) -> str:
        """Rank 0: serve the world's store on a port the OS picks (held from here on, so no
        other process can take it between choosing and binding); ``host:port`` to join."""
        import torch.distributed as dist

        host = ray_shim.require().util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    timeout=STORE_TIMEOUT, wait_for_workers=False)
        return f"{host}:{self._store.port}"

    def start(self, address: str, function: Any, setup: RankSetup | None = None,
              backend: str = "gloo", stages: tuple = ()) -> None:
        import torch.distributed as dist

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(self.local_device or 0))
        store = self._store
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), self.world_size, is_master=False,
                                  timeout=STORE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.world_size)
        self.runtime.build(function, setup, self.world_size, stages)

    def call(self, item: Any) -> Any:
        return self.runtime.function(item)

    def invoke(self, method: str, args: tuple, kwargs: dict, role: str | None = None) -> Any:
        return self.runtime.invoke(method, args, kwargs, role)

    def run_loop(self, spec: Any, hub: Any, num_epochs: int | None):
        return self.runtime.run_loop(spec, hub, num_epochs)

    def serve(self, name: str, attr: str, args: tuple | None, kwargs: dict | None) -> Any:
        """A call on an object this rank published (`mcore_rl.flow.publish`)."""
        return services.serve(name, attr, args, kwargs)

    def kill_group(self) -> None:
        """Kill this rank and the process group it leads (what it started), on its node."""
        os.killpg(os.getpid(), signal.SIGKILL)

    def stop(self) -> None:
        import torch.distributed as dist

        self.runtime.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        # the orderly exit that follows (`close`) skips the module teardown, which the
        # launch's teardown would otherwise wait for
        end_after_exit_handlers(0)


def handoff(item: Any) -> Any:
    """Rank 0: send ``item`` to every rank of the world; elsewhere: receive it."""
    import torch.distributed as dist

    box = [item]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(function: Callable[[Any], Any]) -> None:
    """A rank other than 0: call ``function`` on every input rank 0 hands over, until the end."""
    while True:
        item = handoff(None)
        if isinstance(item, str) and item == END:
            return
        if isinstance(item, str) and item == FAILED:
            raise LeaderFailed("rank 0 failed before handing over the next item; its error "
                               "is the one to read")
        function(item)


class WorkerGroup:
    """The executor over the ranks of one controller."""

    def __init__(self, ranks: list, places: list[tuple[str, int]]):
        self.ranks, self.places = ranks, places

    @classmethod
    def start(cls, spec, setup: RankSetup | None = None, threads: int | None = None,
              backend: str = "gloo", env: dict[str, str] | None = None,
              placements: list[dict] | None = None) -> "WorkerGroup":
        """``spec.num_workers`` ranks on ``spec.devices`` (an `InstanceSpec`, or anything
        with ``function``, ``num_workers`` and ``devices``), joined into one world, with the
        controllers fused into it on rank 0. ``placements``: Ray options per rank (a GPU
        bundle each); default: CPU cores (``spec.devices``), ranks spread over the nodes."""
        actor = ray_shim.actor_class(RankProcess)
        hub = services.current_hub()
        gpu = placements is not None
        if gpu:
            shares, options = [None] * spec.num_workers, placements
        else:
            shares = split_devices(spec.devices, spec.num_workers)
            options = [{"num_cpus": 0, **ray_shim.on_node(node)}
                       for node in rank_nodes(spec.num_workers)]
        # One thread per rank (Ray's default): Megatron's CPU layer is a per-thread torch
        # function mode, entered on the actor's main thread.
        ranks = [actor.options(**opts).remote(rank, spec.num_workers, share, threads, env, hub, gpu)
                 for rank, (share, opts) in enumerate(zip(shares, options))]
        group = cls(ranks, [])
        try:
            group.places = ray_shim.get_all([r.where.remote() for r in ranks])
            address = ray_shim.require().get(ranks[0].rendezvous.remote())
            stages = getattr(spec, "fused", ())
            ray_shim.get_all([r.start.remote(address, spec.function, setup, backend, stages)
                              for r in ranks])
        except BaseException:
            group.kill()
            raise
        return group

    def __call__(self, item: Any) -> Any:
        round_trips.add()
        ref = ray_shim.require().put(item)
        return ray_shim.get_all([r.call.remote(ref) for r in self.ranks])[0]

    def run_loop(self, spec: Any, hub: Any, num_epochs: int | None):
        """The controller's item loop on the ranks (see the module doc); rank 0's stats."""
        return ray_shim.get_all([r.run_loop.remote(spec, hub, num_epochs) for r in self.ranks])[0]

    def invoke(self, method: str, *args: Any, role: str | None = None, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` of the function's object on every rank; rank 0's result.
        ``role``: of the fused controller ``role``'s function instead (on rank 0, its home)."""
        if role is not None:
            return self.invoke_stage(role, method, *args, **kwargs)
        ray = ray_shim.require()
        round_trips.add()
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs)
        return ray_shim.get_all([r.invoke.remote(method, args_ref, kwargs_ref)
                                 for r in self.ranks])[0]

    def invoke_stage(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the fused controller ``role``'s function, on rank 0 (its home)."""
        round_trips.add()
        return ray_shim.require().get(self.ranks[0].invoke.remote(method, args, kwargs, role))

    def processes(self) -> list[tuple[str, int]]:
        return list(self.places)

    def close(self) -> None:
        """Close the function on every rank, leave the world, then let the ranks' processes
        exit (a launch's teardown then finds them gone instead of waiting for them)."""
        try:
            ray_shim.get_all([r.stop.remote() for r in self.ranks])
        except BaseException:
            self.kill()
            raise
        # an orderly exit once its calls are done (a kill is reported), waited for so that
        # the ranks' exit handlers have run before a launch's teardown kills what is left
        exits = [r.__ray_terminate__.remote() for r in self.ranks]
        ray_shim.require().wait(exits, num_returns=len(exits), timeout=EXIT_WAIT_S,
                                fetch_local=False)

    def kill(self) -> None:
        """Every rank's actor and the process groups they lead (engines they started)."""
        ray = ray_shim.require()
        here = ray_shim.node_id()
        remote = [r for r, (node, _) in zip(self.ranks, self.places) if node != here]
        if remote:  # ranks on other nodes kill their own groups
            kills = [r.kill_group.remote() for r in remote]
            ray.wait(kills, num_returns=len(kills), timeout=2.0)
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        for node, pid in self.places:
            if node == here:
                kill_process_group(pid)
