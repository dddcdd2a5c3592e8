"""What the syncs that send GPU to GPU into an engine's own receiving side share (vLLM's
backends, `mcore_rl.reshard.native`; SGLang's NCCL update, `mcore_rl.reshard.sglang_broadcast`):
the plan of the whole model from every rank's holdings, the engines' readiness before a
pass, and one verdict on every rank."""
from __future__ import annotations

import torch.distributed as dist

from mcore_rl.reshard.plan import ReshardPlan


def plan_for_config(chunks: list, arch, cfg, group=None) -> ReshardPlan:
    """The resharding plan of ``chunks`` from every trainer rank's holdings (collective),
    in the wire dtype and buckets of a `ReshardConfig`."""
    from mcore_rl.models.gpt import DTYPES
    from mcore_rl.parallel.agreement import all_gather
    from mcore_rl.reshard.sources import local_holdings, parameters

    holdings = all_gather(local_holdings(chunks, dist.get_rank())[0], group)
    wire = DTYPES.get(cfg.wire_dtype) or parameters(chunks)[0].dtype
    return ReshardPlan.build([h for hs in holdings for h in hs], arch,
                             int(cfg.bucket_mb * 2**20) // 2, wire)


def engines_ready(engines: list, wake: bool, what: str) -> str | None:
    """The controller's engines, ready to receive (``wake``: their weights woken first;
    each answers ``transfer("check")``); why not (prefixed ``what``), or None."""
    try:
        for engine in engines:
            if wake:
                engine.wake_weights()
            engine.transfer("check")
    except Exception as err:  # noqa: BLE001 - agreed on by the caller
        return f"{what}: {err}"
    return None


def agree(error: str | None, group=None) -> str | None:
    """The first rank's error (in group order), on every rank; None if none failed."""
    from mcore_rl.parallel.agreement import all_gather

    return next((e for e in all_gather(error, group) if e is not None), None)
