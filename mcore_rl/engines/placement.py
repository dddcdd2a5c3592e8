"""Where the engine runs beside the trainer, and which CPU cores each side gets.

Decision: **the engine always runs in processes of its own**, started by the role that owns
it (the rollout controller's process; with ``fused``, the trainer's rank 0), which keeps the
handle: on CPU at engine TP1 one host process
(`mcore_rl.engines.vllm_host`) that runs vLLM's engine core and worker in itself; otherwise
vLLM's engine-core process plus one worker process per engine TP rank. Weights reach
those processes through one shared-memory file (`mcore_rl.wire`: the trainer's parameters
themselves on a CPU trainer, buckets otherwise), never through a socket or a pickle.

Measured on the 2-core CPU machine (``mcore-rl bench reshard --placement``: SmolLM2-135M,
fp32, a TP1 trainer with 2 threads, the engine at TP1; two runs on a shared machine):

==============================  ===================  ========================
                                own processes        inside the trainer
==============================  ===================  ========================
engine start                    18.2-18.8 s          5.5-6.7 s
generation (8 x 32 tokens)      162-164 tokens/s     132-147 tokens/s
one weight sync (ours)          0.61-0.79 s          0.62-0.66 s
trainer step, engine idle       2.09-2.14 s          2.33-2.34 s (+9-12 %)
2-rank trainer world            works                rank 0 hangs (> 120 s)
==============================  ===================  ========================

Inside the trainer process the engine starts faster (no process spawn, vLLM already
imported) but everything after that is worse or impossible: vLLM's distributed setup
adopts an already initialised torch.distributed world and builds its groups from it, which
is collective over *every* trainer rank, so an engine in rank 0 alone of a 2-rank world
hangs and each trainer rank would have to host an engine shard (tying engine TP and
replicas to the trainer's world size); its CPU worker binds OpenMP threads and replaces
``torch.set_num_threads`` in the process it runs in, the trainer's; and trainer and engine
then share one interpreter (generation 10-19 % slower, trainer step 9-12 % slower). A
sync through shared memory costs about the same either way. The start-up cost of separate
processes is paid once per run.

(That table's "own processes" were vLLM's engine core and worker. With the one host process
that replaced them at TP1, one later run of the same benchmark gave: engine start 22.5 s
against 13.6 s inside the trainer, generation 106 against 35 tokens/s, one sync 0.45 s
against 1.0 s, trainer step 4.4 s against 4.6 s, on a machine slower than that table's.)

Every placement uses that process layout; they differ in how cores are shared:

- ``colocated`` (and ``fused``, where the rollout role runs in the trainer's first rank and
  starts the engine's processes from there): engine and trainer time-share all cores. The engine's threads are bound to
  all cores (split between engine TP ranks: ``"0-1"`` at TP1, ``"0|1"`` at TP2) and sit
  idle while the trainer runs; on GPU ``sleep()`` frees the KV cache (and offloads weights)
  between rollouts. vLLM's CPU backend has no sleep mode, so on CPU sleeping only fences
  ``generate``.
- ``separate``: engine and trainer get disjoint cores (the engine the first ones, at least
  one per engine TP rank; on 2 cores at TP1: engine ``"0"``, trainer core 1;
  `pin_trainer_process` restricts a trainer rank to its side), so generation for step k+1 could
  overlap training of step k. With fewer cores than engine TP ranks + 1 the split is
  impossible: both sides share all cores, with a warning.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

PLACEMENTS = ("colocated", "separate", "fused")


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
    if placement == "fused":  # the cores are shared as colocated ones are
        placement = "colocated"
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
