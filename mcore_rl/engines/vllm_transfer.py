"""mcore-rl's receiving side of a weight sync, as a backend of vLLM's weight-transfer protocol.

vLLM drives every weight update through its own protocol (``vllm.distributed.weight_transfer``):
``init_weight_transfer_engine`` once, then per update ``start_weight_update``, one
``update_weights`` per chunk and ``finish_weight_update(weight_version)``, which also records
the version that vLLM reports per span of generated tokens. Each call reaches the
`WeightTransferEngine` named by ``weight_transfer_config.backend`` in every worker (every
engine TP rank). `MappedFileEngine` (backend `BACKEND`) is that engine for mcore-rl's CPU
transports (`mcore_rl.reshard.transports`: the shared file, buckets, and the relay into
them), which all end in one file of shared memory that the trainer writes and each worker
maps:

- ``init_info`` (`MappedInit`): the file's path and size, and how sessions load; the worker
  maps the file once (its path is removed as soon as every process mapped it);
- ``start_weight_update``: a session that loads either **direct** (into the live modules,
  `mcore_rl.engines.vllm_direct_load`, where the model has the layout mcore-rl describes) or
  **layerwise** (vLLM's own ``initialize_layerwise_reload`` steps);
- ``update_info`` (`MappedUpdate`): the manifests of one or more buckets (names, shapes,
  offsets, checksums); each bucket is checked against its checksums before anything of it is
  loaded;
- ``finish_weight_update``: what is left of the layerwise reload, and the tied output head
  refreshed (vLLM 0.32 leaves a CPU-repacked tied head stale).

vLLM's worker processes find the backend through the ``vllm.general_plugins`` entry point
that ``setup.py`` declares (`register`; loading it twice is harmless): the registry lives in
each process, and on CPU vLLM spawns its workers.

No method raises: an error is kept and reported through the worker extension
(`mcore_rl.engines.vllm_worker`, ``mcore_rl_transfer_report``), and
the rest of the session loads nothing. When one of several worker processes raises inside a
collective call, vLLM's multi-process executor stops reading the other workers' replies and
every later call would read leftover answers. The client reads the report after each call
that loads (`mcore_rl.engines.vllm_host.weight_update`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mcore_rl.engines.vllm_shim import BACKEND
from mcore_rl.wire import BucketReader, WeightSyncError, check_manifest, read_tensors

LOAD_MODES = ("auto", "layerwise")


def register() -> None:
    """Register `MappedFileEngine` with vLLM's factory (the plugin entry point); a second
    call does nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "MappedFileEngine")


@dataclass
class MappedInit:
    path: str
    """The file of shared memory the trainer writes (a tmpfs path)."""
    nbytes: int
    mode: str = "auto"
    """"auto": direct where the model allows it, else layerwise; "layerwise": always vLLM's."""


@dataclass
class MappedUpdate:
    manifests: list[dict] = field(default_factory=list)
    """The buckets to load, in order (`mcore_rl.wire` manifests)."""
    abort: str | None = None
    """Why the session ends unfinished (the trainer's side failed): nothing more loads, and
    its finish does not ask for every parameter."""


@dataclass
class SessionReport:
    """What a worker's session did so far (plain data: it crosses vLLM's RPC)."""

    mode: str | None = None
    """"direct" or "layerwise" (None: no session started)."""
    seconds: float = 0.0
    """Spent checking and loading the buckets of the last ``update_weights``."""
    error: str | None = None
    """The first error of the session; nothing was loaded after it."""


def _base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class MappedFileEngine(_base()):
    """Loads buckets from the mapped file into this worker's model (module doc)."""

    init_info_cls = MappedInit
    update_info_cls = MappedUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.reader = BucketReader()
        self.mode = "auto"
        self.buffer: torch.Tensor | None = None
        self.report = SessionReport()
        self._direct_load = None  # built at the first session that may use it
        self._direct_built = False
        self._session: str | None = None  # "direct", "layerwise" or None

    # ----- the protocol -------------------------------------------------------------------
    def init_transfer_engine(self, init_info: MappedInit) -> None:
        if init_info.mode not in LOAD_MODES:
            self.report = SessionReport(error=f"load mode {init_info.mode!r}: choose one of "
                                              f"{', '.join(LOAD_MODES)}")
            return
        self.mode = init_info.mode
        try:
            self.buffer = self.reader.open(init_info.path, init_info.nbytes)
            self.report = SessionReport()
        except Exception as err:  # noqa: BLE001 - reported (module doc)
            self.buffer, self.report = None, SessionReport(error=_message(err))

    def start_weight_update(self) -> None:
        self.report = SessionReport(error=self.report.error if self.buffer is None else None)
        if self.report.error is not None:
            return
        try:
            self._session = self._begin()
            self.report.mode = self._session
        except Exception as err:  # noqa: BLE001
            self.report.error = _message(err)

    def receive_weights(self, update_info: MappedUpdate) -> None:
        self.report.seconds = 0.0
        if update_info.abort is not None and self.report.error is None:
            self.report.error = f"aborted: {update_info.abort}"
        if self.report.error is not None or self._session is None:
            return
        start = time.perf_counter()
        try:
            for manifest in update_info.manifests:
                self._load(manifest, len(update_info.manifests) > 1)
        except Exception as err:  # noqa: BLE001
            self.report.error = _message(err)
        self.report.seconds = time.perf_counter() - start

    def finish_weight_update(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            with torch.no_grad():
                if session == "layerwise":
                    finalize_layerwise_reload(self.model, self.model_config)
                refresh_tied_head(self.model)
            if session == "direct" and self.report.error is None:
                self._direct().finish()
        except Exception as err:  # noqa: BLE001
            self.report.error = self.report.error or _message(err)

    def shutdown(self) -> None:
        self.reader.close()
        self.buffer = None

    # ----- the session --------------------------------------------------------------------
    def _begin(self) -> str:
        if self.mode == "auto" and self._direct() is not None:
            self._direct().begin()
            return "direct"
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        return "layerwise"

    def _load(self, manifest: dict, several: bool) -> None:
        try:
            check_manifest(self.buffer, manifest)
            with torch.no_grad():
                if self._session == "direct":
                    self._direct().load(dict(read_tensors(self.buffer, manifest)), self.buffer)
                else:
                    self.model.load_weights(iter(read_tensors(self.buffer, manifest)))
                    _detach_pending_from(self.model, self.buffer)
        except Exception as err:
            if not several:
                raise
            raise WeightSyncError(f"bucket {manifest['bucket'] + 1}/{manifest['num_buckets']} "
                                  f"({_message(err)})") from err

    def _direct(self):
        """This worker's `DirectLoad` (None: the model needs the layerwise reload)."""
        if not self._direct_built:
            from vllm.distributed import (get_tensor_model_parallel_rank,
                                          get_tensor_model_parallel_world_size)
            from vllm.logger import init_logger

            from mcore_rl.engines.vllm_direct_load import DirectLoad

            try:
                direct, why = DirectLoad.build(
                    self.model, self.model_config.hf_config.to_dict(),
                    created_shapes(self.model), get_tensor_model_parallel_world_size(),
                    get_tensor_model_parallel_rank())
            except Exception as err:  # noqa: BLE001 - the layerwise reload still works
                direct, why = None, _message(err)
            if direct is None:
                init_logger(__name__).info("mcore-rl weight sync: vLLM's layerwise reload (%s)",
                                           why)
            self._direct_load, self._direct_built = direct, True
        return self._direct_load


def _message(err: BaseException) -> str:
    # a WeightSyncError's message is complete (e.g. a checksum mismatch)
    return str(err) if isinstance(err, WeightSyncError) else f"{type(err).__name__}: {err}"


def created_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Every parameter of ``model`` with its shape as created (before the CPU backend repacks
    linear weights to shape (0,))."""
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
    """Copy the tensors that layers still waiting for weights hold as views of ``buffer``
    (the next bucket, or the trainer's next step, overwrites it)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    storage = buffer.untyped_storage().data_ptr()
    for module in model.modules():
        for _name, bound in get_layerwise_info(module).loaded_weights:
            for arg, value in bound.arguments.items():
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() == storage:
                    bound.arguments[arg] = value.clone()


def refresh_tied_head(model: torch.nn.Module) -> None:
    """With tied embeddings the output head is never loaded itself: process it again."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
