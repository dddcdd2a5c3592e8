"""Start N local ranks without torchrun, or run in place under torchrun / SLURM.

`mcore-rl train CONFIG --nproc N` calls `run_ranks`; each spawned rank gets the standard
torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and, on CPU, ``OMP_NUM_THREADS`` set to ``threads_per_rank`` so that ranks
sharing a few cores do not oversubscribe them.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from mcore_rl.parallel.ports import free_port, serve_store


def launcher_world_size() -> int | None:
    """World size given by torchrun or SLURM (srun), or None when started by hand."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return None


def adopt_slurm_environment() -> None:
    """Map srun's SLURM_* variables to torch.distributed's (torchrun sets its own)."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def _rank_main(local_rank: int, entry: Callable, args: tuple, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    entry(*args)


def run_ranks(entry: Callable[..., Any], args: tuple, nproc: int, threads_per_rank: int = 1) -> None:
    """Run ``entry(*args)`` on ``nproc`` spawned local ranks (in place when ``nproc`` is 1
    and no launcher is present). A rank that fails stops the others and raises here."""
    env = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "OMP_NUM_THREADS": str(threads_per_rank),
    }
    if nproc == 1:
        _rank_main(0, entry, args, {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        return
    store, store_env = serve_store(nproc)  # held here until the ranks have ended
    env.update(store_env)
    import torch.multiprocessing as tmp

    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank)  # inherited before torch loads
    try:
        tmp.start_processes(_rank_main, args=(entry, args, env), nprocs=nproc, start_method="spawn")
    except tmp.ProcessExitedException as err:
        # A rank that exits on purpose with a status (e.g. stopped on request after saving a
        # checkpoint) ends the run with that status, not a traceback.
        if err.exit_code and err.exit_code > 0:
            raise SystemExit(err.exit_code) from None
        raise
