"""Start torch.distributed and Megatron-Core's model-parallel state; tear them down.

`initialize_parallel` works the same under ``mcore-rl train --nproc N`` (ranks spawned by
us), torchrun and SLURM: it reads the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` environment, or uses a process group that already exists (tests keep one
world alive and switch layouts inside it with `destroy_parallel` + `initialize_parallel`).
"""
from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore_rl.parallel import megatron_cpu_compat
from mcore_rl.parallel.context import Layout, ParallelContext

log = logging.getLogger(__name__)


def default_backend() -> str:
    """nccl with CUDA, gloo without."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str = "auto", timeout_minutes: int = 30) -> None:
    """Join the default process group from the environment (idempotent)."""
    if dist.is_initialized():
        return
    backend = default_backend() if backend == "auto" else backend
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        # A plain single process: a world of one on a free local port.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from mcore_rl.parallel.ports import free_port

            os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))


def initialize_parallel(layout: Layout | None = None, *, tp: int = 1, pp: int = 1,
                        vpp: int | None = None, ep: int = 1, etp: int | None = None,
                        cp: int = 1, seed: int = 1234, backend: str = "auto") -> ParallelContext:
    """Initialise distributed state for ``layout`` (dp inferred from the world size).

    Applies the Megatron CPU compatibility layer when CUDA is unavailable, builds Megatron's
    TP/PP/DP groups (and expert groups: ``ep`` experts-parallel ranks, ``etp`` tensor-parallel
    ranks inside an expert, carved out of the tp x dp ranks of a stage) and seeds its RNG
    tracker. Returns the `ParallelContext` that the rest
    of mcore-rl receives as an argument.
    """
    if layout is not None:
        tp, pp, vpp, ep, etp, cp = layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp, layout.cp
    init_process_group(backend)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        product = f"tp*pp*cp = {tp}*{pp}*{cp}" if cp > 1 else f"tp*pp = {tp}*{pp}"
        raise ValueError(f"world size {world} is not divisible by {product}")
    dp = world // (tp * pp * cp)
    if layout is not None and layout.dp != dp:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, world has {world}")
    layout = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep, etp=etp, cp=cp)
    if (world // pp) % (ep * layout.expert_tp):
        raise ValueError(f"ep*etp = {ep}*{layout.expert_tp} does not divide the {world // pp} "
                         f"ranks of a pipeline stage")
    cpu = not torch.cuda.is_available()
    if cpu:
        megatron_cpu_compat.apply()

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    destroy_parallel()
    groups_before = _live_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # gloo duplicates of every group are only needed by the distributed optimizer's
        # CPU checkpoint path; on CPU the main groups are gloo already.
        create_gloo_process_groups=not cpu,
    )
    _megatron_groups[:] = [g for g in _live_groups() if g not in groups_before]
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    ctx = ParallelContext(
        layout=layout,
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device()),
        backend=dist.get_backend(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        embedding_group=ps.get_embedding_group(check_initialized=False),
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group() if cp > 1 else None,
    )
    log.info("parallel layout %s ready on rank %d (%s)", layout, ctx.rank, ctx.backend)
    return ctx


# Megatron methods memoised with ``functools.lru_cache``: each cache entry keeps its module
# (``self``) alive, and with it the module's process groups, whose gloo threads then outlive
# the layout (a process that builds models for several layouts in turn piles them up).
_CACHED_METHODS = (
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"),
)


def _clear_megatron_method_caches() -> None:
    import importlib

    for module_name, class_name in _CACHED_METHODS:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        cache_clear = getattr(getattr(cls, "forward", None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


# Process groups created by Megatron's initialize_model_parallel for the current layout.
# Megatron drops its references on destroy but leaves most groups alive; each gloo group
# keeps its own threads, so switching layouts in one world would pile them up.
_megatron_groups: list = []


def _live_groups() -> list:
    from torch.distributed import distributed_c10d as c10d

    return [g for g in c10d._world.pg_map if g is not dist.GroupMember.WORLD]


def destroy_parallel(*, keep_process_group: bool = True) -> None:
    """Drop Megatron's model-parallel state and its process groups (and the default
    process group unless kept).

    A destroyed group's gloo threads end only when the last reference to it goes, and
    models, optimizers and their hooks hold groups in reference cycles that only a garbage
    collection frees. Left to the collector's own schedule, a process that builds layout
    after layout kept the threads of all of them (hundreds, waking up all the time: a good
    share of a core per idle rank), so this collects."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _clear_megatron_method_caches()
    live = set(_live_groups()) if dist.is_initialized() else set()
    for group in _megatron_groups:
        if group in live:
            dist.destroy_process_group(group)
    _megatron_groups.clear()
    if not keep_process_group and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
