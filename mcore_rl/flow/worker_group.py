"""The ``worker_group`` strategy: a controller's function run SPMD by ``num_workers``
processes that form one torch.distributed world (gloo here; NCCL is the same shape).

Each rank is a Ray actor pinned to its share of the controller's devices. The function is
built on every rank; per item, every rank is called with the same item (one object-store
reference) and the controller takes rank 0's result, as one controller drives one SPMD
group. A rank that fails fails the call at once, whatever the others are doing."""
from __future__ import annotations

import os
import socket
from typing import Any

from mcore_rl.flow import ray_shim
from mcore_rl.flow.graph import build_function
from mcore_rl.flow.placement import pin_to_cores, split_devices
from mcore_rl.flow.plan import InstanceSpec


class RankProcess:
    """One rank of a worker group (a Ray actor)."""

    def __init__(self, rank: int, world_size: int, devices: tuple[int, ...] | None):
        if os.getpgid(0) != os.getpid():
            os.setpgid(0, 0)
        self.rank, self.world_size = rank, world_size
        pin_to_cores(devices)
        self.function: Any = None

    def where(self) -> tuple[str, int]:
        return ray_shim.node_id(), os.getpid()

    def rendezvous(self) -> str:
        """A ``tcp://`` address on this rank's node for the others to join (rank 0)."""
        host = ray_shim.require().util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, init_method: str, function: Any) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=self.rank,
                                world_size=self.world_size)
        self.function = build_function(function)

    def call(self, item: Any) -> Any:
        return self.function(item)

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
    def start(cls, spec: InstanceSpec) -> "WorkerGroup":
        actor = ray_shim.actor_class(RankProcess)
        shares = split_devices(spec.devices, spec.num_workers)
        ranks = [actor.options(num_cpus=0).remote(rank, spec.num_workers, share)
                 for rank, share in enumerate(shares)]
        places = ray_shim.get_all([r.where.remote() for r in ranks])
        init_method = ray_shim.require().get(ranks[0].rendezvous.remote())
        ray_shim.get_all([r.start.remote(init_method, spec.function) for r in ranks])
        return cls(ranks, places)

    def __call__(self, item: Any) -> Any:
        ref = ray_shim.require().put(item)
        return ray_shim.get_all([r.call.remote(ref) for r in self.ranks])[0]

    def processes(self) -> list[tuple[str, int]]:
        return list(self.places)

    def close(self) -> None:
        ray_shim.get_all([r.stop.remote() for r in self.ranks])
