"""Loading a bucket straight into a running vLLM model's modules (inside a vLLM worker).

vLLM's own reload (``initialize_layerwise_reload``: every layer back on the meta device,
fresh tensors materialised as a layer's weights arrive, loaded, processed, copied back)
is general, and `mcore_rl.engines.vllm_transfer.MappedFileEngine` falls back to it, but for the models mcore-rl
trains much of its work is bookkeeping. Loading SmolLM2-135M (fp32, CPU) through it took
~0.45 s per sync, of which the CPU backend repacking each linear weight for its GEMM (which
any load pays) is ~0.17 s and the bucket checksums ~0.08 s; `DirectLoad` takes ~0.21 s.
It does only what a sync needs, from the engine parameter layout that
`mcore_rl.engines.param_plan` describes (checked against vLLM's live model in tests):

- a weight the engine keeps as a plain tensor (norms, embeddings, biases, every weight on
  GPU) is overwritten in place, its slice of each HF tensor copied where the layout puts it;
- a linear weight the CPU backend repacked (vLLM then keeps only the packed copy, and the
  parameter is empty) is assembled as the engine parameter (fused ``qkv_proj`` /
  ``gate_up_proj`` of this engine TP rank) and handed to the layer's own
  ``process_weights_after_loading``, which repacks it. Where the bucket already holds that
  tensor in the engine's dtype (one piece, or q/k/v and gate/up back to back: engine TP1)
  the assembled weight is a view of the bucket, so nothing is copied before the repack;
  otherwise it is gathered (and cast) into a staging tensor reused from one module to the
  next (at most one engine parameter). Which weights are repacked is decided once, when
  the `DirectLoad` is built;
- an LM head whose kernel keeps a processed copy of its weight (the CPU GEMM handle; for a
  tied head, the embedding's) is processed again once its weight changed.

Used only when every engine parameter maps to a live module with the expected shape and an
unquantized method (`DirectLoad.build` says why not otherwise); anything else, a quantized
model for instance, goes through vLLM's layerwise reload. Every parameter must arrive in
each session; `finish` names the ones that did not.
"""
from __future__ import annotations

import math

import torch

from mcore_rl.engines.param_plan import EngineParam, engine_params
from mcore_rl.wire import WeightSyncError, back_to_back, piece_view

_PLAIN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def _method_name(module: torch.nn.Module) -> str | None:
    method = getattr(module, "quant_method", None)
    return None if method is None else type(method).__name__


class DirectLoad:
    """The engine parameters of one vLLM worker and how to load each (see module doc)."""

    def __init__(self, model: torch.nn.Module, params: list[EngineParam], repacked: set[str]):
        self.model = model
        # A parameter with no source (a vocabulary shard past the real rows) is never sent.
        self.params = {p.name: p for p in params if p.sources}
        self.repacked = repacked
        """Parameters the CPU backend keeps only in packed form (decided once, when built)."""
        self.by_source: dict[str, list[EngineParam]] = {}
        for p in self.params.values():
            for s in p.sources:
                self.by_source.setdefault(s.hf_name, []).append(p)
        self.loaded: set[str] = set()
        self._staging: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def build(cls, model: torch.nn.Module, hf_config: dict, created_shapes: dict[str, list[int]],
              tp: int, rank: int) -> tuple["DirectLoad | None", str]:
        """A `DirectLoad` for this worker, or None and the reason it does not apply.
        ``created_shapes``: each parameter's shape as vLLM created it (before repacking)."""
        from mcore_rl.models.hf_config import spec_from_hf_config

        try:
            arch = spec_from_hf_config(hf_config).arch
        except Exception as err:  # noqa: BLE001 - an architecture mcore-rl does not map
            return None, f"the model is not one mcore-rl maps ({err})"
        if arch.is_moe:
            return None, ("mixture of experts: vLLM's own loader places the experts in its "
                          "fused, padded expert tensors")
        if _zen_without_prepack():
            return None, ("vLLM's Zen CPU GEMM without prepacking keeps the weight it was given, "
                          "which would be the bucket")
        params, repacked = engine_params(arch, tp, rank), set()
        for p in params:
            module_name, _, attr = p.name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                return None, f"the engine has no module {module_name}"
            live = getattr(module, attr, None)
            if not isinstance(live, torch.Tensor):
                return None, f"{module_name} has no tensor {attr}"
            if list(created_shapes.get(p.name, ())) != list(p.shape):
                return None, (f"{p.name} was created with shape {created_shapes.get(p.name)}, "
                              f"mcore-rl's layout says {list(p.shape)}")
            if _method_name(module) not in (None, *_PLAIN_METHODS):
                return None, f"{module_name} uses {_method_name(module)}"
            if live.numel() != math.prod(p.shape):
                if _method_name(module) != "UnquantizedLinearMethod" or live.numel():
                    return None, f"{p.name} holds {live.numel()} elements, not {list(p.shape)}"
                repacked.add(p.name)
        return cls(model, params, repacked), ""

    # ----- one session -------------------------------------------------------------------
    def begin(self) -> None:
        self.loaded = set()

    def load(self, tensors: dict[str, torch.Tensor], buffer: torch.Tensor) -> None:
        """Load every engine parameter fed by ``tensors`` (HF name -> view of ``buffer``)."""
        touched = {p.name: p for name in tensors for p in self.by_source.get(name, ())}
        for p in touched.values():
            missing = [s.hf_name for s in p.sources if s.hf_name not in tensors]
            if missing:
                raise WeightSyncError(f"{p.name} arrived without {', '.join(missing)} in the "
                                      "same bucket")
            parts = [tensors[s.hf_name].narrow(p.axis, s.start, s.length) for s in p.sources]
            self._load_param(p, parts, buffer)
            self.loaded.add(p.name)

    def finish(self) -> None:
        """End a complete session: every parameter must have arrived."""
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise WeightSyncError(f"the sync did not send {', '.join(missing[:3])}{more}")

    # ----- one parameter -----------------------------------------------------------------
    def _load_param(self, p: EngineParam, parts: list[torch.Tensor], buffer: torch.Tensor) -> None:
        module_name, _, attr = p.name.rpartition(".")
        module = self.model.get_submodule(module_name)
        live = getattr(module, attr)
        if p.name not in self.repacked:  # a plain tensor: overwrite in place (casting)
            _copy_along(live, p.axis, parts)
            if _is_lm_head(module):
                module.quant_method.process_weights_after_loading(module)
            return
        # Repacked by the CPU backend: give the layer the whole weight, in the engine's dtype
        # (the empty placeholder keeps it), and let it repack; then the placeholder again.
        weight = self._assemble(p, parts, buffer, live.dtype)
        placeholder = live
        module.register_parameter(attr, torch.nn.Parameter(weight, requires_grad=False))
        try:
            module.quant_method.process_weights_after_loading(module)
        except BaseException:
            module.register_parameter(attr, placeholder)
            raise
        kept = getattr(module, attr)
        if kept.numel() and kept.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
            # this kernel reads the weight as it is: give it its own, not the bucket's memory
            module.register_parameter(attr, torch.nn.Parameter(kept.detach().clone(),
                                                               requires_grad=False))

    def _assemble(self, p: EngineParam, parts: list[torch.Tensor], buffer: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
        """``p``'s full tensor in ``dtype``: a view of ``buffer`` where the parts already are
        that tensor (one part, or parts back to back along axis 0); otherwise the parts
        gathered into the staging tensor (one per dtype, reused)."""
        numel = math.prod(p.shape)
        whole = sum(t.shape[p.axis] for t in parts) == p.shape[p.axis]
        if (whole and parts[0].dtype == dtype and back_to_back(parts)
                and (len(parts) == 1 or p.axis == 0)):
            start = parts[0].data_ptr() - buffer.data_ptr()
            nbytes = numel * parts[0].element_size()
            if 0 <= start and start + nbytes <= buffer.numel():
                return piece_view(buffer, start, nbytes, dtype, p.shape)
        staging = self._staging.get(dtype)
        if staging is None or staging.numel() < numel:
            staging = self._staging[dtype] = torch.empty(numel, dtype=dtype)
        out = staging[:numel].view(p.shape)
        if not whole:
            out.zero_()  # rows past the sources (vocabulary padding) stay zero
        _copy_along(out, p.axis, parts)
        return out


def _copy_along(out: torch.Tensor, axis: int, parts: list[torch.Tensor]) -> None:
    """Copy ``parts`` one after another along ``axis`` into ``out`` (casting)."""
    at = 0
    for part in parts:
        out.narrow(axis, at, part.shape[axis]).copy_(part)
        at += part.shape[axis]


def _zen_without_prepack() -> bool:
    try:
        from vllm import envs
        from vllm.platforms import current_platform
    except ImportError:  # stand-in modules in tests
        return False
    is_zen = getattr(current_platform, "is_zen_cpu", lambda: False)()
    return bool(is_zen and not getattr(envs, "VLLM_ZENTORCH_WEIGHT_PREPACK", True))


def _is_lm_head(module: torch.nn.Module) -> bool:
    """An untied LM head: its kernel keeps a processed copy of the weight on CPU. (An input
    embedding's lookup reads the weight itself; a tied head is refreshed at the end.)"""
    return type(module).__name__ == "ParallelLMHead" and _method_name(module) is not None
