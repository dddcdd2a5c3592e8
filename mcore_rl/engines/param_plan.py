"""The parameters an inference engine builds for a Llama-style model, and the HF rows they hold.

vLLM and SGLang fuse the same way (their ``packed_modules_mapping``): ``qkv_proj`` holds
q, k, v and ``gate_up_proj`` holds gate, up, *per engine TP shard*: rank r's ``qkv_proj`` is
[q heads of r; k heads of r; v heads of r]. With more engine ranks than KV heads, each rank
holds a copy of one KV head (rank r: head r * ng // tp). The vocabulary is padded to a
multiple of 64 and split evenly; padding rows receive nothing. A tied ``lm_head`` is the
embedding's parameter, so it is not a parameter of its own. Legend as in `mcore_rl.models.mapping`.

Used to check an engine's parameters against what the stream sends (names, shapes, fusion
order; tests compare it with vLLM's live model and with a manifest made from SGLang's own
model code; a test helper traces each engine parameter back to the trainer ranks that
feed it).
"""
from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.models.arch import ModelArch

VOCAB_PADDING = 64


@dataclass(frozen=True)
class Source:
    """Rows (or columns, along the parameter's ``axis``) ``start:start+length`` of an HF tensor."""

    hf_name: str
    start: int
    length: int


@dataclass(frozen=True)
class EngineParam:
    """One parameter of one engine TP rank."""

    name: str
    shape: tuple[int, ...]
    axis: int
    """Axis along which ``sources`` are concatenated (and along which TP splits it)."""
    sources: tuple[Source, ...]
    """HF slices in the order they fill the parameter; rows past them are padding."""


def _rows(tp: int, rank: int, total: int) -> tuple[int, int]:
    per = total // tp
    return rank * per, per


def _kv_heads(arch: ModelArch, tp: int, rank: int) -> tuple[int, int]:
    ng = arch.num_kv_heads
    if tp <= ng:
        return _rows(tp, rank, ng)
    return rank * ng // tp, 1  # replicated KV head


def _vocab(name: str, hf: str, arch: ModelArch, tp: int, rank: int) -> EngineParam:
    padded = -(-arch.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    start, rows = _rows(tp, rank, padded)
    real = max(0, min(rows, arch.vocab_size - start))
    sources = (Source(hf, start, real),) if real else ()
    return EngineParam(name, (rows, arch.hidden_size), 0, sources)


def engine_params(arch: ModelArch, tp: int = 1, rank: int = 0) -> list[EngineParam]:
    """The parameters of engine TP rank ``rank`` of ``tp``, in model order."""
    h, d, f = arch.hidden_size, arch.kv_channels, arch.intermediate_size
    nq = arch.num_attention_heads
    out = [_vocab("model.embed_tokens.weight", "model.embed_tokens.weight", arch, tp, rank)]
    q0, nq_r = _rows(tp, rank, nq)
    k0, nk_r = _kv_heads(arch, tp, rank)
    f0, f_r = _rows(tp, rank, f)
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}"
        attn = f"{p}.self_attn"
        qkv_rows = (nq_r + 2 * nk_r) * d
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            rest = (h,) if kind == "weight" else ()
            out.append(EngineParam(f"{attn}.qkv_proj.{kind}", (qkv_rows, *rest), 0, (
                Source(f"{attn}.q_proj.{kind}", q0 * d, nq_r * d),
                Source(f"{attn}.k_proj.{kind}", k0 * d, nk_r * d),
                Source(f"{attn}.v_proj.{kind}", k0 * d, nk_r * d))))
        if arch.qk_norm:  # per-head norms, replicated on every engine rank
            out += [EngineParam(f"{attn}.{n}_norm.weight", (d,), 0,
                                (Source(f"{attn}.{n}_norm.weight", 0, d),)) for n in "qk"]
        out += [
            EngineParam(f"{attn}.o_proj.weight", (h, nq_r * d), 1,
                        (Source(f"{attn}.o_proj.weight", q0 * d, nq_r * d),)),
            EngineParam(f"{p}.mlp.gate_up_proj.weight", (2 * f_r, h), 0, (
                Source(f"{p}.mlp.gate_proj.weight", f0, f_r),
                Source(f"{p}.mlp.up_proj.weight", f0, f_r))),
            EngineParam(f"{p}.mlp.down_proj.weight", (h, f_r), 1,
                        (Source(f"{p}.mlp.down_proj.weight", f0, f_r),)),
            EngineParam(f"{p}.input_layernorm.weight", (h,), 0,
                        (Source(f"{p}.input_layernorm.weight", 0, h),)),
            EngineParam(f"{p}.post_attention_layernorm.weight", (h,), 0,
                        (Source(f"{p}.post_attention_layernorm.weight", 0, h),)),
        ]
    out.append(EngineParam("model.norm.weight", (h,), 0, (Source("model.norm.weight", 0, h),)))
    if not arch.tie_word_embeddings:  # a tied head *is* the embedding parameter
        out.append(_vocab("lm_head.weight", "lm_head.weight", arch, tp, rank))
    return out


def hf_tensors_needed(arch: ModelArch, tp: int = 1) -> set[str]:
    """Every HF tensor some engine rank reads."""
    return {s.hf_name for r in range(tp) for p in engine_params(arch, tp, r) for s in p.sources}
