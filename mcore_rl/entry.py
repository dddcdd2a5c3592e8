"""What every rank of `mcore-rl train` runs."""
from __future__ import annotations

import json

from mcore_rl.config import RLConfig
from mcore_rl.parallel import Layout, destroy_parallel, initialize_parallel


def rank_main(cfg: RLConfig) -> None:
    """Initialise the layout, run the job, write its summary (rank 0)."""
    from pathlib import Path

    from mcore_rl.train.smoke import run_smoke

    p = cfg.parallel
    ctx = initialize_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp, seed=cfg.train.seed, backend=p.backend)
    if ctx.rank == 0:
        print(f"mcore-rl: {ctx.world_size} rank(s), layout {ctx.layout}, device {ctx.device.type}",
              flush=True)
    losses = run_smoke(cfg, ctx, steps=cfg.train.steps)
    if ctx.rank == 0:
        out = Path(cfg.logging.dir)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"layout": str(ctx.layout), "steps": len(losses), "losses": losses}
        (out / "smoke_summary.json").write_text(json.dumps(summary, indent=1))
        print(f"mcore-rl: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
              f"summary in {out / 'smoke_summary.json'}", flush=True)
    destroy_parallel(keep_process_group=False)


def rank_main_from_dict(data: dict) -> None:
    """Picklable entry for spawned ranks (the config travels as a plain dict)."""
    from mcore_rl.config.loader import _build

    rank_main(_build(RLConfig, data, ""))


__all__ = ["rank_main", "rank_main_from_dict", "Layout"]
