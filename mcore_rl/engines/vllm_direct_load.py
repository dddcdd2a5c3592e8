"""Loading a bucket straight into a running vLLM model's modules (inside a vLLM worker).

vLLM's own reload (``initialize_layerwise_reload``: every layer back on the meta device,
fresh tensors materialised as a layer's weights arrive, loaded, processed, copied back)
is general, and `ReshardWorkerExtension` falls back to it, but for the models mcore-rl
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
  ``process_weights_after_loading``, which repacks it. Where the pieces already lie back to
  back in the bucket (engine TP1) the assembled weight is a view of the bucket, so nothing
  is copied before the repack; otherwise it is gathered into a staging tensor reused from
  one module to the next (at most one engine parameter);
- an LM head whose kernel keeps a processed copy of its weight (the CPU GEMM handle; for a
  tied head, the embedding's) is processed again once its weight changed.

Used only when every engine parameter maps to a live module with the expected shape and an
unquantized method (`DirectLoad.build` says why not otherwise); anything else, a quantized
model for instance, goes through vLLM's layerwise reload. Every parameter must arrive
exactly once per session; `finish` names the ones that did not.
"""
from __future__ import annotations

import math

import torch

from mcore_rl.engines.param_plan import EngineParam, engine_params
from mcore_rl.reshard.bucket import WeightSyncError

_PLAIN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def _method_name(module: torch.nn.Module) -> str | None:
    method = getattr(module, "quant_method", None)
    return None if method is None else type(method).__name__


class DirectLoad:
    """The engine parameters of one vLLM worker and how to load each (see module doc)."""

    def __init__(self, model: torch.nn.Module, params: list[EngineParam]):
        self.model = model
        self.params = {p.name: p for p in params}
        self.by_source: dict[str, list[EngineParam]] = {}
        for p in params:
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
        params = engine_params(arch, tp, rank)
        for p in params:
            module_name, _, attr = p.name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                return None, f"the engine has no module {module_name}"
            if not isinstance(getattr(module, attr, None), torch.Tensor):
                return None, f"{module_name} has no tensor {attr}"
            if list(created_shapes.get(p.name, ())) != list(p.shape):
                return None, (f"{p.name} was created with shape {created_shapes.get(p.name)}, "
                              f"mcore-rl's layout says {list(p.shape)}")
            if _method_name(module) not in (None, *_PLAIN_METHODS):
                return None, f"{module_name} uses {_method_name(module)}"
        return cls(model, params), ""

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
        if live.numel() == math.prod(p.shape):  # a plain tensor: overwrite in place
            at = 0
            for part in parts:
                live.narrow(p.axis, at, part.shape[p.axis]).copy_(part)
                at += part.shape[p.axis]
            if _is_lm_head(module):
                module.quant_method.process_weights_after_loading(module)
            return
        # Repacked by the CPU backend: give the layer the whole weight and let it repack.
        weight = self._assemble(p, parts, buffer)
        module.register_parameter(attr, torch.nn.Parameter(weight, requires_grad=False))
        module.quant_method.process_weights_after_loading(module)
        kept = getattr(module, attr)
        if kept.numel() and _shares_memory(kept, weight):  # the kernel reads it as it is
            module.register_parameter(attr, torch.nn.Parameter(kept.detach().clone(),
                                                               requires_grad=False))

    def _assemble(self, p: EngineParam, parts: list[torch.Tensor],
                  buffer: torch.Tensor) -> torch.Tensor:
        """``p``'s full tensor: a view of ``buffer`` where the parts lie back to back along
        axis 0 and fill it; otherwise the parts gathered into the staging tensor."""
        if p.axis == 0 and sum(t.shape[0] for t in parts) == p.shape[0] and _adjacent(parts):
            first = parts[0]
            start = first.data_ptr() - buffer.data_ptr()
            if 0 <= start and start + math.prod(p.shape) * first.element_size() <= buffer.numel():
                nbytes = math.prod(p.shape) * first.element_size()
                return buffer[start:start + nbytes].view(first.dtype).view(p.shape)
        dtype = parts[0].dtype
        numel = math.prod(p.shape)
        staging = self._staging.get(dtype)
        if staging is None or staging.numel() < numel:
            staging = self._staging[dtype] = torch.empty(numel, dtype=dtype)
        out = staging[:numel].view(p.shape)
        if sum(t.shape[p.axis] for t in parts) != p.shape[p.axis]:
            out.zero_()  # rows past the sources (vocabulary padding) stay zero
        at = 0
        for part in parts:
            out.narrow(p.axis, at, part.shape[p.axis]).copy_(part)
            at += part.shape[p.axis]
        return out


def _adjacent(parts: list[torch.Tensor]) -> bool:
    if not all(t.is_contiguous() for t in parts):
        return False
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
               for a, b in zip(parts, parts[1:]))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _is_lm_head(module: torch.nn.Module) -> bool:
    """An untied LM head: its kernel keeps a processed copy of the weight on CPU. (An input
    embedding's lookup reads the weight itself; a tied head is refreshed at the end.)"""
    return type(module).__name__ == "ParallelLMHead" and _method_name(module) is not None
