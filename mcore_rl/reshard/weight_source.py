"""The resharding plan as vLLM's ``WeightSource``: the trainer's weights, as HF tensors, for
the trainer-side engines of vLLM's weight-transfer protocol.

vLLM's trainer-side engines (``vllm.distributed.weight_transfer``: nccl, ipc, ...) take a
``WeightSource`` and send what it yields: ``metadata()`` (name, wire dtype, full shape of
every tensor, in the order iteration yields them) and iteration over ``(name, tensor)``,
fresh on every pass, in lockstep on every trainer rank. `plan_source` makes one from a
`WeightSync` (every trainer rank builds its own, collectively):

- ``metadata()`` is the plan's tensors in bucket order: the embedding, the layers in order,
  the final norm and the head, i.e. the order of vLLM's ``layerwise_groups``, so vLLM's own
  order check (``iter_groups``) holds;
- iterating streams the buckets as a sync does: every rank writes and delivers its pieces
  of bucket k through the sync's transport (a collective), the controller checks the
  writers' checksums over the bucket (``check_manifest``), and then yields the bucket's
  tensors as views of it. Every rank iterates every name (``held_names()`` is None
  everywhere: each bucket is a collective of all ranks), and the ranks other than the
  controller yield ``None`` for each: the controller is the one that sends (vLLM's trainer
  engines send from one rank, and the others only take part in the collectives). The
  source yields copies: vLLM batches a layer's tensors (``iter_groups``) and a layer can
  span more buckets than the transport keeps (the buckets transport reuses the memory of
  bucket k for bucket k+2). `bucket_tensors` alone yields views, for a consumer that is
  done with each tensor before it asks for the next.

A failure in any bucket (a rank failing to write, a checksum) is raised on every rank
(`WeightSyncError`), as in a sync.
"""
from __future__ import annotations

from typing import Iterator

import torch

from mcore_rl.parallel.agreement import backend_device, broadcast_verdict
from mcore_rl.wire import WeightSyncError, check_manifest, read_tensors


def bucket_tensors(sync, version: int = 0) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every HF tensor of ``sync``'s plan in bucket order, streamed through its transport
    (collective; module doc): views of the bucket on the controller, None elsewhere."""
    plan, channel = sync.plan, sync.channel
    is_controller = sync.rank == sync.controller
    views = sync.local_views()
    for k, bucket in enumerate(plan.buckets):
        gathered = sync.write_bucket(k, views)
        error, tensors = None, []
        if is_controller:
            failures = [f for _, f in gathered if f]
            try:
                if failures:
                    raise WeightSyncError(failures[0])
                sums = {key: value for m, _ in gathered for key, value in m.items()}
                manifest = plan.manifest(k, sums, version, sync.writer.algorithm)
                check_manifest(channel.buffer, manifest)
                tensors = read_tensors(channel.buffer, manifest)
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                error = f"weight source, bucket {k + 1}/{len(plan.buckets)}: {err}"
        error = broadcast_verdict(error, sync.controller, sync.group, backend_device(sync.group))
        if error is not None:
            raise WeightSyncError(error)
        if is_controller:
            yield from tensors
        else:
            for t in bucket.tensors:
                yield t.hf_name, None
    channel.end_sync(True)


def plan_source(sync, version: int = 0):
    """``sync``'s plan as a ``vllm.distributed.weight_transfer.WeightSource`` (module doc)."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    class PlanSource(WeightSource):
        def __init__(self) -> None:
            self.sync, self.version = sync, version
            self._metadata = [ParamMeta(t.hf_name, sync.plan.wire_dtype, tuple(t.shape))
                              for b in sync.plan.buckets for t in b.tensors]

        def metadata(self) -> list:
            return list(self._metadata)

        def __iter__(self):
            for name, tensor in bucket_tensors(self.sync, self.version):
                yield name, None if tensor is None else tensor.clone()

    return PlanSource()


__all__ = ["bucket_tensors", "plan_source"]
