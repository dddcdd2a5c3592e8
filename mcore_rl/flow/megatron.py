"""The Megatron strategy: a controller's function run SPMD over a worker group of
``tp * pp * dp`` ranks with Megatron-Core's model-parallel state initialised on each.

    Controller(role="trainer", data_input=reward, function=factory(Trainer, cfg),
               strategy=Megatron(tp=2))

The function (or the factory that builds it) runs on every rank after the layout is set
up and reads it with `rank_context()`: the rank's `ParallelContext` (its TP/PP/DP groups,
its rank within each), as every model and train engine of `mcore_rl` takes it. The
controller hands each item to every rank and passes on rank 0's result."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TYPE_CHECKING

from mcore_rl.errors import UsageError

if TYPE_CHECKING:  # torch and Megatron load only in the ranks
    from mcore_rl.parallel import ParallelContext

_context: ParallelContext | None = None


def rank_context() -> ParallelContext:
    """This worker-group rank's `ParallelContext` (set up by the `Megatron` strategy)."""
    if _context is None:
        raise UsageError("rank_context() is only available inside a controller run with "
                         "strategy=Megatron(...)")
    return _context


@dataclass(frozen=True)
class MegatronSetup:
    """What each rank runs after joining the world: Megatron's parallel state."""

    tp: int
    pp: int
    vpp: int | None
    seed: int
    backend: str
    ep: int = 1
    etp: int | None = None
    cp: int = 1

    def __call__(self, rank: int, world_size: int) -> None:
        global _context
        from mcore_rl.parallel import initialize_parallel

        _context = initialize_parallel(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep,
                                       etp=self.etp, cp=self.cp, seed=self.seed,
                                       backend=self.backend)

    @staticmethod
    def outside():
        """What a fused (non-Megatron) stage on the rank runs inside: without the CPU layer's
        torch function mode, which costs a Python call per torch operation."""
        from mcore_rl.parallel import megatron_cpu_compat

        return megatron_cpu_compat.suspended()


@dataclass(frozen=True)
class Megatron:
    """A Megatron layout as a controller strategy: ``tp * pp * cp * dp`` ranks in one world."""

    runs_ranks: ClassVar[bool] = True
    """Its ranks are processes of their own, one rank included (`gpu_placement.runs_ranks`)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    seed: int = 1234
    """Megatron's RNG seed (model-parallel streams), as ``train.seed`` is for the CLI."""
    threads_per_rank: int = 1
    """torch threads per rank on CPU when the controller has no devices to pin to."""
    backend: str = "auto"
    """torch.distributed backend: nccl with CUDA, gloo without (``auto``)."""
    ep: int = 1
    """Expert parallelism of MoE layers (within the data-parallel ranks, as Megatron has it)."""
    etp: int | None = None
    """Expert tensor parallelism (None: the same as ``tp``)."""
    cp: int = 1
    """Context parallelism: each sequence split over ``cp`` ranks."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "threads_per_rank"):
            if getattr(self, name) < 1:
                raise UsageError(f"Megatron strategy: {name} must be >= 1, got {getattr(self, name)}")
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            raise UsageError(f"Megatron strategy: vpp={self.vpp} needs pp >= 2 and vpp >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def rank_setup(self, backend: str | None = None) -> MegatronSetup:
        """What each rank runs after joining the world (``backend``: the world's)."""
        from mcore_rl.parallel.initialize import default_backend

        backend = backend or (default_backend() if self.backend == "auto" else self.backend)
        return MegatronSetup(self.tp, self.pp, self.vpp, self.seed, backend, self.ep, self.etp,
                             self.cp)

    def __call__(self, spec, placements: list[dict] | None = None):
        from mcore_rl.flow.worker_group import WorkerGroup
        from mcore_rl.parallel.initialize import default_backend

        backend = self.backend
        if backend == "auto":  # ranks with GPU bundles: NCCL (this process may see no GPU)
            backend = "nccl" if placements is not None else default_backend()
        return WorkerGroup.start(spec, self.rank_setup(backend), threads=self.threads_per_rank,
                                 backend=backend, placements=placements)

    def __str__(self) -> str:
        return f"Megatron(tp={self.tp}, pp={self.pp}, dp={self.dp})"
