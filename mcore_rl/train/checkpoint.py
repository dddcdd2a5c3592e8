"""Full training state of a `TrainEngine` in Megatron's distributed checkpoint format.

What is saved: model chunks, optimizer (Adam moments, fp32 main params), LR scheduler,
per-rank RNG states (CPU and Megatron's tracker), the layout, and any ``extra`` values the
caller adds (RL step, data position). Model weights and optimizer state are sharded tensors,
so they load at any valid TP/PP/DP layout; RNG states are restored only at the same layout.

Directories are written complete or not at all: the caller's path receives the checkpoint
only after every rank finished (written to ``<path>.tmp`` then renamed by rank 0).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.models.checkpoint import save_sharded
from mcore_rl.train.engine import TrainEngine

FORMAT_VERSION = 1


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _model_sharded_state_dict(engine: TrainEngine) -> dict:
    chunks = [_unwrap(m) for m in engine.model]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _layout(engine: TrainEngine) -> dict:
    lay = engine.ctx.layout
    return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "vpp": lay.vpp,
            **({"cp": lay.cp} if lay.cp > 1 else {})}


def _rng_object(engine: TrainEngine, state: Any):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    c = engine.ctx
    if c.cp > 1:  # one RNG state per rank: the CP ranks' too
        return ShardedObject("rng_state", state, (c.pp, c.tp, c.cp, c.dp),
                             (c.pp_rank, c.tp_rank, c.cp_rank, c.dp_rank), replica_id=0)
    return ShardedObject("rng_state", state, (c.pp, c.tp, c.dp), (c.pp_rank, c.tp_rank, c.dp_rank),
                         replica_id=0)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_engine(engine: TrainEngine, path: str | Path, extra: dict | None = None) -> Path:
    """Save the full state of ``engine`` to ``path`` (collective over all ranks)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _model_sharded_state_dict(engine)
    if engine.optimizer is not None:
        state["optimizer"] = engine.optimizer.sharded_state_dict(state)
    if engine.scheduler is not None:
        state["scheduler"] = engine.scheduler.state_dict()
    state["rng_state"] = _rng_object(engine, _rng_state())
    state["mcore_rl"] = {"format_version": FORMAT_VERSION, "layout": _layout(engine),
                         "steps_done": engine.steps_done, "extra": extra or {}}
    save_sharded(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist.barrier()
    return path


def read_checkpoint_info(path: str | Path) -> dict:
    """The ``mcore_rl`` header of a checkpoint (layout, steps, extras), without tensors."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(path))["mcore_rl"]


def load_engine(engine: TrainEngine, path: str | Path, *, load_optimizer: bool = True) -> dict:
    """Load a checkpoint into ``engine`` (collective). Returns the saved ``extra`` values.

    Weights (and optimizer state) load at any layout; RNG states only at the saved one.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a complete mcore-rl checkpoint (no metadata.json)")
    info = read_checkpoint_info(path)
    same_layout = info["layout"] == _layout(engine)
    request = _model_sharded_state_dict(engine)
    with_optimizer = load_optimizer and engine.optimizer is not None
    if with_optimizer:
        request["optimizer"] = engine.optimizer.sharded_state_dict(request, is_loading=True)
    if same_layout:
        request["rng_state"] = _rng_object(engine, None)
    loaded = dist_checkpointing.load(request, str(path))
    chunks = [_unwrap(m) for m in engine.model]
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"model{i}"])
    if with_optimizer:
        engine.optimizer.load_state_dict(loaded["optimizer"])
        if engine.scheduler is not None and "scheduler" in loaded:
            engine.scheduler.load_state_dict(loaded["scheduler"])
        engine.steps_done = info["steps_done"]
    elif engine.optimizer is not None:
        engine.optimizer.reload_model_params()  # fp32 main copies of bf16 weights follow the load
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return info["extra"]
