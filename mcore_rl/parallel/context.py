"""`ParallelContext`: the layout of one job and its process groups, passed explicitly.

Megatron-Core 0.16's schedules, DDP, optimizer and checkpointing read its global parallel
state (``megatron.core.parallel_state``). That global is touched only in this package
(`initialize_parallel` / `destroy_parallel`) and in ``mcore_rl.train``; everything else
receives a `ParallelContext`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore_rl.parallel import agreement


@dataclass(frozen=True)
class Layout:
    """Sizes of a 3D-parallel layout: tp x pp x dp ranks, vpp model chunks per PP rank."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    ep: int = 1
    """Expert-parallel size: the experts of a mixture-of-experts layer are split over ep
    ranks (Megatron carves it out of the ranks of one pipeline stage: tp x dp)."""
    etp: int | None = None
    """Tensor-parallel size inside each expert; None: ``tp`` (Megatron's default)."""
    cp: int = 1
    """Context-parallel size: each sequence is split over cp ranks
    (`mcore_rl.parallel.context_parallel`)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def __str__(self) -> str:
        vpp = f"xVPP{self.vpp}" if self.vpp else ""
        ep = f"xEP{self.ep}" if self.ep > 1 else ""
        etp = f"xETP{self.etp}" if self.etp is not None and self.etp != self.tp else ""
        cp = f"xCP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}{cp}xPP{self.pp}{vpp}xDP{self.dp}{ep}{etp}"


@dataclass
class ParallelContext:
    """Where this rank sits in the layout, and the process groups it talks over.

    Megatron orders ranks tp-fastest, then dp, then pp ("tp-cp-ep-dp-pp"): the ranks of
    one TP group are consecutive; one PP group strides over tp*dp ranks.
    """

    layout: Layout
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: str
    tp_group: dist.ProcessGroup | None = field(repr=False)
    pp_group: dist.ProcessGroup | None = field(repr=False)
    dp_group: dist.ProcessGroup | None = field(repr=False)
    mp_group: dist.ProcessGroup | None = field(repr=False)
    embedding_group: dist.ProcessGroup | None = field(repr=False, default=None)
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = field(repr=False, default=None)
    """The ranks that split each sequence with this one (None without CP)."""
    world_group: dist.ProcessGroup | None = field(repr=False, default=None)
    """Every rank of this job (the trainer's world); None: torch.distributed's default group.
    Job-wide collectives (broadcasting a rollout, barriers) go over it, so the trainer can
    be one group among several in a larger world."""

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def vpp(self) -> int | None:
        return self.layout.vpp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def expert_tp(self) -> int:
        return self.layout.expert_tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def controller(self) -> int:
        """Global rank that drives the rollout engine and writes the logs: the job's first rank."""
        if self.world_group is None:
            return 0
        return dist.get_process_group_ranks(self.world_group)[0]

    @property
    def is_controller(self) -> bool:
        return self.rank == self.controller

    def barrier(self) -> None:
        """Wait for every rank of the job (no-op in a one-rank job)."""
        agreement.barrier(self.world_group)

    def broadcast_object(self, obj):
        """The controller's ``obj`` on every rank of the job (pickled; for batches and small
        Python values, not for weights)."""
        return agreement.broadcast(obj, self.controller, self.world_group)

    def group_ranks(self, group: dist.ProcessGroup | None) -> list[int]:
        """Global ranks of a process group (``[self.rank]`` for a size-1 layout)."""
        if group is None:
            return [self.rank]
        return dist.get_process_group_ranks(group)
