"""Which engine module an HF tensor is loaded into: the unit a bucket never splits."""
from __future__ import annotations

_FUSED = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))


def engine_module(hf_name: str) -> str:
    """The engine module an HF tensor is loaded into (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

    Engines fuse these per TP shard as they load, so the tensors of one fused module must
    arrive in the same bucket."""
    module = hf_name.rsplit(".", 1)[0]
    head, _, last = module.rpartition(".")
    for parts, fused in _FUSED:
        if last in parts:
            return f"{head}.{fused}"
    return module
