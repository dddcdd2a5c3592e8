"""Runs inside vLLM's worker processes: one weight-update session fed bucket by bucket.

vLLM is started with ``worker_extension_cls="mcore_rl.engines.vllm_worker.ReshardWorkerExtension"``;
its methods become ``collective_rpc`` targets on every worker (every engine TP rank). Their
arguments are plain Python (paths, manifests), which is what ``collective_rpc`` can carry
to multi-process workers (tensors in its kwargs arrive as lists there); the tensors
themselves are read from the shared-memory file (`mcore_rl.wire`: buckets, or
with the shared transport the trainer's parameters), which each worker maps once
(``mcore_rl_attach_buffer``) and keeps mapped from one sync to the next.

One sync is one session, in one of two ways, chosen when it begins:

- **direct** (`mcore_rl.engines.vllm_direct_load`, whenever the live model has the layout
  mcore-rl describes and unquantized weights): each bucket's checksums are checked first
  (nothing of a bad bucket is loaded), then its tensors go straight into the live modules:
  plain weights overwritten in place, CPU-repacked linear weights repacked by the layer's
  own ``process_weights_after_loading`` (from a view of the bucket where it holds the
  whole engine parameter);
- **layerwise**, otherwise: the steps of vLLM's own ``reload_weights`` spread over several
  calls. ``initialize_layerwise_reload`` at the start puts every layer back on the meta
  device and wraps its weight loaders; each bucket then goes through ``model.load_weights``
  with HF-named views of the bucket, and a layer whose weights are complete is
  materialised, loaded, processed and copied into the original storage. Layers still
  waiting (vocabulary rows padded by vLLM are never "complete": they finish at the end)
  would keep views of the file, which the next bucket (or the trainer's next step)
  overwrites: those are copied.
  ``finalize_layerwise_reload`` at the end processes what is left.

Either way, with tied embeddings the output head shares the embedding's weight but is never
loaded itself, so vLLM 0.32 leaves its CPU-repacked copy stale (vLLM's own
``reload_weights`` gives outdated logits for tied models on CPU): its processing is run
again at the end.

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

from mcore_rl.wire import BucketReader, WeightSyncError, check_manifest, read_tensors


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

    def _mcore_rl_direct(self):
        """The worker's `DirectLoad`, built at the first session (None: layerwise)."""
        if not hasattr(self, "_mcore_rl_direct_load"):
            from vllm.distributed import (get_tensor_model_parallel_rank,
                                          get_tensor_model_parallel_world_size)
            from vllm.logger import init_logger

            from mcore_rl.engines.vllm_direct_load import DirectLoad

            try:
                direct, why = DirectLoad.build(
                    self.model_runner.get_model(), self.model_config.hf_config.to_dict(),
                    _created_shapes(self.model_runner.get_model()),
                    get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
            except Exception as err:  # noqa: BLE001 - the layerwise reload still works
                direct, why = None, f"{type(err).__name__}: {err}"
            if direct is None:
                init_logger(__name__).info("mcore-rl weight sync: vLLM's layerwise reload (%s)", why)
            self._mcore_rl_direct_load = direct
        return self._mcore_rl_direct_load

    @_reported
    def mcore_rl_begin_update(self, path: str, nbytes: int, mode: str = "auto") -> str:
        """Start a session (``mode``: "auto" or "layerwise"); returns how it loads:
        "direct" or "layerwise"."""
        return self._mcore_rl_begin(path, nbytes, mode)

    @_reported
    def mcore_rl_load_bucket(self, manifest: dict, begin: list | None = None,
                             finish: bool = False) -> tuple[float, str | None]:
        """Check and load one bucket; ``begin``: the arguments of `mcore_rl_begin_update`
        for a session that starts with this bucket; ``finish``: it is the last one. Returns
        the seconds spent (checksums included) and, with ``begin``, how the session loads."""
        start = time.perf_counter()
        mode = self._mcore_rl_begin(*begin) if begin is not None else None
        buffer = self._mcore_rl_buffer
        check_manifest(buffer, manifest)
        with torch.no_grad():
            if self._mcore_rl_session_direct:
                self._mcore_rl_direct().load(dict(read_tensors(buffer, manifest)), buffer)
            else:
                self._mcore_rl_model.load_weights(iter(read_tensors(buffer, manifest)))
                _detach_pending_from(self._mcore_rl_model, buffer)
        if finish:
            self._mcore_rl_finish(complete=True)
        return time.perf_counter() - start, mode

    @_reported
    def mcore_rl_finish_update(self, complete: bool = True) -> None:
        """End the session (``complete``: False when it is aborted) and drop the bucket."""
        self._mcore_rl_finish(complete)

    def _mcore_rl_begin(self, path: str, nbytes: int, mode: str) -> str:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._mcore_rl_session_direct = False
        self._mcore_rl_buffer = self._mcore_rl_open(path, nbytes)
        self._mcore_rl_model = self.model_runner.get_model()
        self._mcore_rl_session_direct = mode == "auto" and self._mcore_rl_direct() is not None
        if self._mcore_rl_session_direct:
            self._mcore_rl_direct().begin()
            return "direct"
        initialize_layerwise_reload(self._mcore_rl_model)
        return "layerwise"

    def _mcore_rl_finish(self, complete: bool) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = getattr(self, "_mcore_rl_model", None)
        self._mcore_rl_buffer = None
        self._mcore_rl_model = None
        if model is None:  # no session, or it already ended
            return
        direct = self._mcore_rl_session_direct
        with torch.no_grad():
            if not direct:
                finalize_layerwise_reload(model, self.model_config)
            _refresh_tied_head(model)
        self.model_runner.reset_lora_state()
        if direct and complete:
            self._mcore_rl_direct().finish()

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
        return _created_shapes(self.model_runner.get_model())


def _created_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

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
