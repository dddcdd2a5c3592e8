"""Where the engine runs beside the trainer, and which CPU cores each side gets.

Decision (measured on the 2-core CPU machines, tiny Llama and SmolLM2-135M; numbers from
``mcore-rl bench reshard --placement``, see ``benchmarks/reshard.py``):

**The engine always runs in processes of its own** (vLLM's engine-core process, plus one
worker process per engine TP rank), started from the controlling trainer rank (global
rank 0), which keeps the client handle. Weights reach those processes through one
shared-memory bucket file (`mcore_rl.reshard.bucket`), never through a socket or a pickle.
The alternative, vLLM inside the trainer's processes, was measured and rejected:

- vLLM's distributed setup adopts an already initialised torch.distributed world: every
  trainer rank must then build an engine (its groups are made from the whole world), so
  the engine TP/replica layout is tied to the trainer's world size;
- vLLM's CPU worker binds the process's OpenMP threads to cores and replaces
  ``torch.set_num_threads`` process-wide, so the trainer can no longer size its own thread
  pool (measured: the trainer step got slower after the engine started in-process);
- what it would save is small: a sync through shared memory already costs far less than
  the engine's generation for a step (see the numbers in ``benchmarks/reshard.py``).

Both placements use that process layout; they differ in how cores are shared:

- ``colocated``: engine and trainer time-share all cores. The engine's threads are bound to
  all cores (split between engine TP ranks) and sit idle while the trainer runs; on GPU
  ``sleep()`` frees the KV cache (and offloads weights) between rollouts. vLLM's CPU
  backend has no sleep mode, so on CPU sleeping only fences ``generate``.
- ``separate``: engine and trainer get disjoint cores (the engine the first ones, one per
  engine TP rank at least), so generation for step k+1 could overlap training of step k.
  With fewer cores than engine TP ranks + 1 the split is impossible: both sides share all
  cores, with a warning.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

PLACEMENTS = ("colocated", "separate")


@dataclass(frozen=True)
class CpuPlacement:
    """Cores of the engine's TP ranks and of the trainer ranks."""

    engine_cpus: tuple[tuple[int, ...], ...]
    """Per engine TP rank, the cores its OpenMP threads are bound to."""
    trainer_cpus: tuple[int, ...]
    """Cores the trainer ranks run on."""

    @property
    def omp_bind(self) -> str:
        """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` value, e.g. ``"0-1"`` or ``"0|1"``."""
        return "|".join(_cpu_range(c) for c in self.engine_cpus)


def _cpu_range(cpus: tuple[int, ...]) -> str:
    if list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan_cpu_placement(placement: str, engine_tp: int, cpus: list[int] | None = None) -> CpuPlacement:
    """Split ``cpus`` (default: this process's allowed cores) between engine and trainer."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    cpus = list(cpus or available_cpus())
    if placement == "separate" and len(cpus) > engine_tp:
        engine_count = max(engine_tp, len(cpus) // 2)
        engine, trainer = cpus[:engine_count], cpus[engine_count:]
    else:
        if placement == "separate":
            warnings.warn(f"placement=separate needs more than {engine_tp} cores for engine TP "
                          f"{engine_tp} plus the trainer; {len(cpus)} available: sharing them",
                          stacklevel=2)
        engine, trainer = cpus, cpus
    if len(engine) < engine_tp:  # more engine ranks than cores: ranks share cores
        per_rank = [(engine[r % len(engine)],) for r in range(engine_tp)]
    else:
        size = len(engine) // engine_tp
        per_rank = [tuple(engine[r * size:(r + 1) * size]) for r in range(engine_tp)]
    return CpuPlacement(engine_cpus=tuple(per_rank), trainer_cpus=tuple(trainer))


def pin_trainer_process(plan: CpuPlacement, threads: int | None = None) -> None:
    """Restrict this trainer rank to the trainer's cores (call on every trainer rank)."""
    import torch

    os.sched_setaffinity(0, plan.trainer_cpus)
    torch.set_num_threads(threads or 1)
