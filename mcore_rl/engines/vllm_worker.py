"""Runs inside vLLM's worker processes: what a weight sync needs besides vLLM's protocol.

vLLM is started with ``worker_extension_cls="mcore_rl.engines.vllm_worker.ReshardWorkerExtension"``;
its methods become ``collective_rpc`` targets on every worker (every engine TP rank). The
sync itself goes through vLLM's weight-transfer protocol, whose receiving side is
`mcore_rl.engines.vllm_transfer.MappedFileEngine`; this extension reads that engine's report
(its load mode, the seconds it spent, its first error), and offers the naive reload from a
directory and the parameter shapes that check the engine parameter plan.

Every method returns ``("ok", value)`` or ``("error", message)`` instead of raising: when
one of several worker processes raises inside ``collective_rpc``, vLLM's multi-process
executor stops reading the other workers' replies, and every later call would then read
the previous call's leftover answers.
"""
from __future__ import annotations

import functools

import torch

from mcore_rl.engines.vllm_transfer import created_shapes, refresh_tied_head
from mcore_rl.wire import WeightSyncError


def _reported(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return "ok", method(self, *args, **kwargs)
        except WeightSyncError as err:  # its message is complete (e.g. a checksum mismatch)
            return "error", str(err)
        except Exception as err:  # noqa: BLE001 - sent back to the client, which raises
            return "error", f"{type(err).__name__}: {err}"
    return call


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class; method names are prefixed to avoid clashes."""

    @_reported
    def mcore_rl_transfer_report(self) -> dict:
        """The weight-transfer engine's report on its current session
        (`mcore_rl.engines.vllm_transfer.SessionReport`, as a dict)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "report"):
            raise WeightSyncError(f"the engine's weight transfer is not mcore-rl's "
                                  f"({type(engine).__name__})")
        return dict(vars(engine.report))

    @_reported
    def mcore_rl_reload_from_dir(self, path: str) -> None:
        """vLLM's own reload from an HF directory (the naive path), with the tied-head fix."""
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        with torch.no_grad():
            refresh_tied_head(self.model_runner.get_model())

    @_reported
    def mcore_rl_param_shapes(self) -> dict[str, list[int]]:
        """Every parameter of this worker's model with its shape as created (before the CPU
        backend repacks linear weights to shape (0,)), to check the engine parameter plan."""
        return created_shapes(self.model_runner.get_model())
