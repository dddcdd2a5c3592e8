"""Resharding: stream the trainer's Megatron weights (any TP/PP/VPP/DP layout) into rollout
engines after every step, in bounded buckets, checked, verified (the wire format both
sides read: `mcore_rl.wire`).

    sync = WeightSync(train.model, arch, engines=[engine] if rank == 0 else None,
                      bucket_mb=cfg.reshard.bucket_mb)         # once, on every trainer rank
    stats = sync.sync(version=step)                            # after every optimizer step
    verify_engine_logprobs(train, engine, probe_prompts(V), temperature=T,
                           tolerance=0.05)                     # cfg.reshard.verify

- `plan`: `ReshardPlan` (which rank writes which slice of which HF tensor, into which bucket);
- `stream`: `WeightSync`, the collective per-step sync;
- `verify`: engine vs trainer log-probs on a probe batch.
"""
from mcore_rl.wire import BucketChecksumError, WeightSyncError
from mcore_rl.reshard.plan import Holding, ReshardPlan
from mcore_rl.reshard.stream import SyncStats, WeightSync
from mcore_rl.reshard.verify import LogprobMismatchError, probe_prompts, verify_engine_logprobs

__all__ = ["BucketChecksumError", "Holding", "LogprobMismatchError", "ReshardPlan", "SyncStats",
           "WeightSync", "WeightSyncError", "probe_prompts", "verify_engine_logprobs"]
