"""The ``worker_group`` strategy: a controller's function run SPMD by ``num_workers``
processes that form one torch.distributed world (gloo on CPU, NCCL on GPU).

Each rank is a Ray actor pinned to its share of the controller's devices. The function is
built on every rank; per item, every rank is called with the same item (one object-store
reference) and the controller takes rank 0's result, as one controller drives one SPMD
group. A rank that fails fails the call at once, whatever the others are doing. A driver
may also call any method of the function's object on every rank at once (`WorkerGroup.
invoke`): that is how `mcore_rl.RLTrainer` drives its ranks. On a Ray cluster of several
nodes the ranks fill the nodes evenly, rank 0 on the caller's node (`cluster.rank_nodes`)."""
from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any, Callable

from mcore_rl.flow import ray_shim, services
from mcore_rl.flow.cluster import rank_nodes
from mcore_rl.flow.graph import build_function
from mcore_rl.flow.placement import pin_to_cores, split_devices

STORE_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits on the world's store (joining, and every collective's setup)."""

RankSetup = Callable[[int, int], None]
"""Run on every rank after it joined the world, before the function is built: ``(rank,
world_size)``; e.g. the Megatron strategy's model-parallel state."""


class RankProcess:
    """One rank of a worker group (a Ray actor)."""

    def __init__(self, rank: int, world_size: int, devices: tuple[int, ...] | None,
                 threads: int | None = None, env: dict[str, str] | None = None,
                 hub: Any = None):
        if os.getpgid(0) != os.getpid():
            os.setpgid(0, 0)
        services.set_hub(hub)
        os.environ.update(env or {})
        self.rank, self.world_size = rank, world_size
        pin_to_cores(devices)
        if threads is not None and not devices:
            import torch

            torch.set_num_threads(threads)
        self.function: Any = None
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
              backend: str = "gloo") -> None:
        import torch.distributed as dist

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(self.rank))
        store = self._store
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), self.world_size, is_master=False,
                                  timeout=STORE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.world_size)
        if setup is not None:
            setup(self.rank, self.world_size)
        self.function = build_function(function)

    def call(self, item: Any) -> Any:
        return self.function(item)

    def invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.function, method)(*args, **kwargs)

    def kill_group(self) -> None:
        """Kill this rank and the process group it leads (what it started), on its node."""
        os.killpg(os.getpid(), signal.SIGKILL)

    def stop(self) -> None:
        import torch.distributed as dist

        close = getattr(self.function, "close", None)
        if callable(close):
            close()
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerGroup:
    """The executor over the ranks of one controller."""

    def __init__(self, ranks: list, places: list[tuple[str, int]]):
        self.ranks, self.places = ranks, places

    @classmethod
    def start(cls, spec, setup: RankSetup | None = None, threads: int | None = None,
              backend: str = "gloo", env: dict[str, str] | None = None) -> "WorkerGroup":
        """``spec.num_workers`` ranks on ``spec.devices`` (an `InstanceSpec`, or anything
        with ``function``, ``num_workers`` and ``devices``), joined into one world."""
        actor = ray_shim.actor_class(RankProcess)
        shares = split_devices(spec.devices, spec.num_workers)
        hub = services.current_hub()
        # One thread per rank (Ray's default): Megatron's CPU layer is a per-thread torch
        # function mode, entered on the actor's main thread.
        # On a cluster of several nodes the ranks fill them evenly (`cluster.rank_nodes`).
        nodes = rank_nodes(spec.num_workers)
        ranks = [actor.options(num_cpus=0, **ray_shim.on_node(node)).remote(
                     rank, spec.num_workers, share, threads, env, hub)
                 for rank, (share, node) in enumerate(zip(shares, nodes))]
        group = cls(ranks, [])
        try:
            group.places = ray_shim.get_all([r.where.remote() for r in ranks])
            address = ray_shim.require().get(ranks[0].rendezvous.remote())
            ray_shim.get_all([r.start.remote(address, spec.function, setup, backend)
                              for r in ranks])
        except BaseException:
            group.kill()
            raise
        return group

    def __call__(self, item: Any) -> Any:
        ref = ray_shim.require().put(item)
        return ray_shim.get_all([r.call.remote(ref) for r in self.ranks])[0]

    def invoke(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` of the function's object on every rank; rank 0's result."""
        ray = ray_shim.require()
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs)
        return ray_shim.get_all([r.invoke.remote(method, args_ref, kwargs_ref)
                                 for r in self.ranks])[0]

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
        for r in self.ranks:  # an orderly exit once its calls are done (a kill is reported)
            r.__ray_terminate__.remote()

    def kill(self) -> None:
        """Every rank's actor and the process groups they lead (engines they started)."""
        from mcore_rl.flow.controller import kill_process_group

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
