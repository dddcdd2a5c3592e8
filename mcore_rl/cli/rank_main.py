"""What every rank of `mcore-rl train` runs (part of the CLI: it joins the launcher's world)."""
from __future__ import annotations

import json
import os
import sys

from mcore_rl.config import RLConfig
from mcore_rl.errors import UsageError
from mcore_rl.parallel import Layout, destroy_parallel, init_process_group, initialize_parallel


def rank_main(cfg: RLConfig) -> None:
    """Join the world (preflight), initialise the layout, run the job, write its summary.

    On an agreed stop request (preemption) the run saves a checkpoint and this process
    exits with `stop_exit_code()` after acknowledging it; see `mcore_rl.launch.stop_signal`.
    """
    from pathlib import Path

    from mcore_rl.launch.preflight import describe, run_preflight
    from mcore_rl.engines.liveness import EngineDiedError
    from mcore_rl.launch.stop_signal import StopRequested, StopSignal, stop_exit_code
    from mcore_rl.train.smoke import run_smoke

    # vLLM logs every request at INFO; keep the console for the run's own progress, and
    # its warnings (an engine that dies says why).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    stop = StopSignal().install()
    p = cfg.parallel
    init_process_group(p.backend)
    peers = run_preflight(timeout_s=cfg.launch.preflight_timeout_s, device=_device())
    ctx = initialize_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, seed=cfg.train.seed,
                              backend=p.backend)
    if ctx.rank == 0:
        print(f"mcore-rl: {ctx.world_size} rank(s), layout {ctx.layout}, device {ctx.device.type}; "
              f"preflight ok: {describe(peers)}", flush=True)
    try:
        if cfg.train.job == "rl":
            from mcore_rl.trainer import train

            train(cfg, ctx, stop=stop)
            destroy_parallel(keep_process_group=False)
            return
        if cfg.train.job != "smoke":  # sft, rm, dpo, kto
            from mcore_rl.finetune.loop import run_finetune

            run_finetune(cfg, ctx, stop=stop)
            destroy_parallel(keep_process_group=False)
            return
        losses = run_smoke(cfg, ctx, steps=cfg.train.steps, stop=stop)
    except UsageError as err:
        # Bad input found by a rank (e.g. a reward function that raises): one line, exit 2.
        # Checkpoints already written stay complete (the `latest` pointer only moves after one).
        where = f" (rank {ctx.rank})" if ctx.rank else ""
        print(f"mcore-rl train: error{where}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except EngineDiedError as err:
        # The engine's own words are in the message (its last output); no traceback of ours.
        print(f"mcore-rl train: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except StopRequested as req:
        stop.acknowledge(ctx, req.step)
        if ctx.rank == 0:
            print(f"mcore-rl: stopped on request after step {req.step}; checkpoint "
                  f"{req.checkpoint}; resume by running the same command again", flush=True)
        destroy_parallel(keep_process_group=False)
        raise SystemExit(stop_exit_code()) from None
    finally:
        stop.uninstall()
    if ctx.rank == 0:
        out = Path(cfg.logging.dir)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"layout": str(ctx.layout), "steps": len(losses), "losses": losses,
                   "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}
        (out / "smoke_summary.json").write_text(json.dumps(summary, indent=1))
        print(f"mcore-rl: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
              f"summary in {out / 'smoke_summary.json'}", flush=True)
    destroy_parallel(keep_process_group=False)


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def rank_main_from_dict(data: dict) -> None:
    """Picklable entry for spawned ranks (the config travels as a plain dict)."""
    from mcore_rl.config.loader import _build

    rank_main(_build(RLConfig, data, ""))


__all__ = ["rank_main", "rank_main_from_dict", "Layout"]
