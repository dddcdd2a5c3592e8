"""Runs inside vLLM's worker processes: one weight-update session fed bucket by bucket.

vLLM is started with ``worker_extension_cls="mcore_rl.engines.vllm_worker.ReshardWorkerExtension"``;
its methods become ``collective_rpc`` targets on every worker (every engine TP rank). Their
arguments are plain Python (paths, manifests), which is what ``collective_rpc`` can carry
to multi-process workers (tensors in its kwargs arrive as lists there); the tensors
themselves are read from the shared-memory bucket file (`mcore_rl.reshard.bucket`), which
each worker maps once (``mcore_rl_attach_buffer``) and keeps mapped from one sync to the next.

One sync is one session, the same steps as vLLM's own ``reload_weights`` but spread over
several calls:

- begin: ``initialize_layerwise_reload`` puts every layer back on the meta device and wraps
  its weight loaders, so loading buffers a layer's weights until all of them arrived;
- each bucket: the checksum of every piece checked first (nothing of a bad bucket is loaded),
  then ``model.load_weights`` with HF-named views of the bucket. A layer whose weights are
  complete is materialised, loaded, processed (the CPU backend repacks linear weights for
  its GEMM here) and copied into the original storage inside that call. Layers still
  waiting (vocabulary rows padded by vLLM are never "complete": they finish at the end)
  would keep views of the bucket file, which the next bucket overwrites: those are copied;
- finish: ``finalize_layerwise_reload`` processes what is left. With tied embeddings the
  output head shares the embedding's weight but is never loaded itself, so vLLM 0.32 leaves
  its CPU-repacked copy stale (vLLM's own ``reload_weights`` gives outdated logits for tied
  models on CPU): its processing is run again here.

Every method returns ``("ok", value)`` or ``("error", message)`` instead of raising: when
one of several worker processes raises inside ``collective_rpc``, vLLM's multi-process
executor stops reading the other workers' replies, and every later call would then read
the previous call's leftover answers.

Only vLLM internals that ``reload_weights`` itself uses are touched.
"""
from __future__ import annotations

import functools
import time

import torch

from mcore_rl.reshard.bucket import BucketReader, WeightSyncError, check_manifest, read_tensors


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

    def _mcore_rl_open(self, path: str, nbytes: int):
        if not hasattr(self, "_mcore_rl_reader"):
            self._mcore_rl_reader = BucketReader()  # the mapping is kept between syncs
        return self._mcore_rl_reader.open(path, nbytes)

    @_reported
    def mcore_rl_attach_buffer(self, path: str, nbytes: int) -> None:
        """Map the bucket file (its path is removed right after every process mapped it)."""
        self._mcore_rl_open(path, nbytes)

    @_reported
    def mcore_rl_begin_update(self, path: str, nbytes: int) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._mcore_rl_buffer = self._mcore_rl_open(path, nbytes)
        self._mcore_rl_model = self.model_runner.get_model()
        initialize_layerwise_reload(self._mcore_rl_model)

    @_reported
    def mcore_rl_load_bucket(self, manifest: dict) -> float:
        """Check and load one bucket; seconds spent (checksums included)."""
        start = time.perf_counter()
        buffer = self._mcore_rl_buffer
        check_manifest(buffer, manifest)
        with torch.no_grad():
            self._mcore_rl_model.load_weights(iter(read_tensors(buffer, manifest)))
            _detach_pending_from(self._mcore_rl_model, buffer)
        return time.perf_counter() - start

    @_reported
    def mcore_rl_finish_update(self) -> None:
        """Process what is pending and drop the bucket mapping (also after a failed sync)."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = getattr(self, "_mcore_rl_model", None)
        if model is not None:
            with torch.no_grad():
                finalize_layerwise_reload(model, self.model_config)
                _refresh_tied_head(model)
            self.model_runner.reset_lora_state()
        self._mcore_rl_buffer = None
        self._mcore_rl_model = None

    @_reported
    def mcore_rl_release_buffer(self) -> None:
        """Unmap the bucket file (its memory is freed once the trainer removed it too)."""
        if hasattr(self, "_mcore_rl_reader"):
            self._mcore_rl_reader.close()

    @_reported
    def mcore_rl_reload_from_dir(self, path: str) -> None:
        """vLLM's own reload from an HF directory (the naive path), with the tied-head fix."""
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        with torch.no_grad():
            _refresh_tied_head(self.model_runner.get_model())

    @_reported
    def mcore_rl_param_shapes(self) -> dict[str, list[int]]:
        """Every parameter of this worker's model with its shape as created (before the CPU
        backend repacks linear weights to shape (0,)), to check the engine parameter plan."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        shapes = {name: list(p.shape) for name, p in model.named_parameters()}
        for module_name, module in model.named_modules():
            params, _ = get_layerwise_info(module).restore_metadata
            for name, meta in params.items():  # biases are never put on meta: live shape
                full = f"{module_name}.{name}" if module_name else name
                if full in shapes:  # a tied head's weight is the embedding's (listed once)
                    shapes[full] = list(meta.shape)
        return shapes


def _detach_pending_from(model: torch.nn.Module, buffer: torch.Tensor) -> None:
    """Copy tensors that layers still waiting for weights hold as views of ``buffer``."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    storage = buffer.untyped_storage().data_ptr()
    for module in model.modules():
        for _name, bound in get_layerwise_info(module).loaded_weights:
            for arg, value in bound.arguments.items():
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() == storage:
                    bound.arguments[arg] = value.clone()


def _refresh_tied_head(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
