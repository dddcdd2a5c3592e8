"""Build actor, reference, critic and reward models for a `ParallelContext`, weights loaded.

A *source* is an HF model directory (``config.json`` + safetensors) or an mcore-rl checkpoint
(`mcore_rl.models.checkpoint`). Roles:

- ``actor`` / ``reference``: causal LM (``head="lm"``) from a causal-LM source.
- ``critic``: scalar head. From a causal LM the head is fresh (seeded, the same on every
  rank); from a ``*ForSequenceClassification`` source or a critic/reward checkpoint it is
  loaded.
- ``reward``: scalar head, loaded; the source must have one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mcore_rl.errors import UsageError
from mcore_rl.models.arch import ModelArch
from mcore_rl.models.hf_config import LM_HEAD, SCORE_HEAD, ModelSpec, load_hf_spec

ROLE_HEADS = {"actor": LM_HEAD, "reference": LM_HEAD, "critic": SCORE_HEAD, "reward": SCORE_HEAD}


@dataclass
class BuiltModel:
    """This rank's model chunks and the spec they were built from."""

    chunks: list
    """One Megatron module per virtual pipeline stage (one without VPP)."""
    spec: ModelSpec
    """Spec of the built model (its ``head`` is the built head; ``arch`` has the padded
    vocabulary used)."""
    role: str


def check_layout(arch: ModelArch, tp: int, pp: int, vpp: int | None = None, ep: int = 1,
                 etp: int | None = None) -> None:
    """`UsageError` (one line) unless ``arch`` splits over TP ``tp``, PP ``pp`` x VPP, and
    (mixture of experts) EP ``ep`` x expert TP ``etp`` (None: ``tp``)."""
    problems = []
    ffn = () if arch.is_moe else (("intermediate_size", arch.intermediate_size),)
    for name, value in (("num_attention_heads", arch.num_attention_heads),
                        ("num_key_value_heads", arch.num_kv_heads), *ffn):
        if value % tp:
            problems.append(f"{name} {value}")
    if problems:
        raise UsageError(f"TP {tp} does not divide {' and '.join(problems)}")
    etp = tp if etp is None else etp
    if not arch.is_moe and ep > 1:
        raise UsageError(f"EP {ep} needs a mixture-of-experts model; this one is dense")
    if arch.is_moe and arch.num_experts % ep:
        raise UsageError(f"EP {ep} does not divide the {arch.num_experts} experts")
    if arch.is_moe and arch.moe_intermediate_size % etp:
        raise UsageError(f"expert TP {etp} does not divide the expert FFN size "
                         f"{arch.moe_intermediate_size}")
    stages = pp * (vpp or 1)
    if arch.num_layers % stages:
        raise UsageError(f"PP {pp}{f' x VPP {vpp}' if vpp else ''} does not divide "
                         f"num_hidden_layers {arch.num_layers}")
    if arch.padded_vocab_size % tp:
        raise UsageError(f"TP {tp} does not divide the padded vocabulary {arch.padded_vocab_size} "
                         f"(pad multiple {arch.vocab_pad_multiple}, stored with the checkpoint)")


def read_model_spec(source: str | Path) -> ModelSpec:
    """The spec of an HF directory or mcore-rl checkpoint."""
    from mcore_rl.models.checkpoint import is_mcore_checkpoint, read_checkpoint_meta

    if is_mcore_checkpoint(source):
        return read_checkpoint_meta(source).spec
    return load_hf_spec(source)


def build_model(source: str | Path, ctx, role: str = "actor", dtype: str = "fp32",
                recompute: str = "none", transformer_engine: bool | None = None,
                seed: int = 1234, moe=None, sequence_parallel: bool = False) -> BuiltModel:
    """Build this rank's chunks for ``role`` and load their weights from ``source``.

    Collective when ``source`` is an mcore-rl checkpoint (Megatron's distributed load).
    ``moe``: `mcore_rl.models.moe.MoeOptions` for expert layers (default options if None).
    ``sequence_parallel``: split the sequence over the TP ranks between the tensor-parallel
    blocks (always on for a mixture-of-experts model under TP).
    """
    from mcore_rl.models.checkpoint import is_mcore_checkpoint, load_mcore_weights
    from mcore_rl.models.gpt import DTYPES, build_gpt_chunks
    from mcore_rl.models.hf_weights import HFWeightSource, load_hf_weights

    if role not in ROLE_HEADS:
        raise UsageError(f"unknown role {role!r} (roles: {', '.join(ROLE_HEADS)})")
    is_checkpoint = is_mcore_checkpoint(source)
    source_spec = read_model_spec(source)
    head = ROLE_HEADS[role]
    if head == LM_HEAD and source_spec.head != LM_HEAD:
        raise UsageError(f"the {role} needs a causal LM; {source} has a scalar score head")
    if role == "reward" and source_spec.head != SCORE_HEAD:
        raise UsageError(f"a reward model needs a trained score head (an HF "
                         f"{source_spec.family.sequence_classification} with num_labels=1, or "
                         f"a converted one); {source} is a causal LM")
    arch = source_spec.arch
    if not is_checkpoint:  # a checkpoint keeps its padded size; an HF model gets one for this TP
        arch = arch.with_vocab_multiple_for_tp(ctx.tp)
    check_layout(arch, ctx.tp, ctx.pp, ctx.vpp, ctx.ep, ctx.expert_tp)
    chunks = build_gpt_chunks(arch, ctx, dtype, recompute, transformer_engine, head=head,
                              init_weights=False, seed=seed, moe=moe, sequence_parallel=sequence_parallel)
    fresh_head = ("output_layer.weight",) if head != source_spec.head else ()
    if is_checkpoint:
        load_mcore_weights(chunks, source, skip_keys=fresh_head)
    else:
        hf = HFWeightSource(source, replace(source_spec, arch=arch), DTYPES[dtype])
        hf.check_matches_config()
        load_hf_weights(chunks, hf, skip_keys=fresh_head)
    return BuiltModel(chunks=chunks, spec=replace(source_spec, arch=arch, head=head), role=role)
