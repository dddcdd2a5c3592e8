"""Resharding: stream the trainer's Megatron weights (any TP/PP/VPP/DP layout) into rollout
engines after every step, in bounded, checked buckets.

    sync = WeightSync.build(train.model, arch, engines=[engine] if rank == 0 else None,
                            bucket_mb=cfg.reshard.bucket_mb)   # once, on every trainer rank
    stats = sync.sync(version=step)                            # after every optimizer step

- `plan`: `ReshardPlan` (which rank writes which slice of which HF tensor, into which bucket);
- `stream`: `WeightSync`, the coordinator: one engine update session per sync;
- `transports`: how the bytes reach the engines (shared file, buckets, relay), by name;
- `writer`: each rank's copies of a bucket, on its writer threads;
- `sources`: what each rank holds; `gather`: the naive path (the whole model on one rank).

The wire format both sides read is `mcore_rl.wire`.
"""
from mcore_rl.reshard.plan import Holding, ReshardPlan
from mcore_rl.reshard.stream import SyncStats, WeightSync
from mcore_rl.wire import BucketChecksumError, WeightSyncError

__all__ = ["BucketChecksumError", "Holding", "ReshardPlan", "SyncStats", "WeightSync",
           "WeightSyncError"]
