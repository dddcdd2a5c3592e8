"""HF ``config.json`` -> `ModelSpec` (a `ModelArch`, its family, its head), or one clear error.

Supported: the causal LM and the single-label ``*ForSequenceClassification`` class of every
family in `MODEL_FAMILIES` (Llama incl. Llama 3 RoPE scaling, Qwen2/Qwen2.5, Qwen3,
Qwen3-MoE, Mistral, Mixtral). Anything
mcore-rl cannot reproduce exactly (another architecture, a RoPE type, sliding windows, biases
HF's Llama can add...) raises `UsageError` with one line saying what is supported. Both the
transformers 5 config layout (``rope_parameters``) and the 4.x one (``rope_theta`` +
``rope_scaling``) are read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.errors import UsageError
from mcore_rl.models.arch import ModelArch, RopeScaling
from mcore_rl.models.families import (ModelFamily, family_of_architecture,
                                      supported_architectures)
from mcore_rl.models.rope import SUPPORTED_ROPE_TYPES

LM_HEAD = "lm"
"""A causal LM: logits over the vocabulary (``lm_head``, or the tied embedding)."""
SCORE_HEAD = "score"
"""A scalar head hidden -> 1 (HF ``*ForSequenceClassification`` with one label): critic/reward."""


@dataclass(frozen=True)
class ModelSpec:
    """What to build: architecture, HF family and output head, with the HF config it came from."""

    arch: ModelArch
    family: ModelFamily
    head: str
    """`LM_HEAD` or `SCORE_HEAD`."""
    hf_config: dict
    """The HF ``config.json`` as a dict (written back on export)."""

    @property
    def hf_architecture(self) -> str:
        family = self.family
        return family.causal_lm if self.head == LM_HEAD else family.sequence_classification


def read_config_json(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UsageError(f"no config.json in {hf_dir}: not a HuggingFace model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err})") from None


def load_hf_spec(hf_dir: str | Path, vocab_pad_multiple: int = 128) -> ModelSpec:
    """The `ModelSpec` of the HF model in ``hf_dir`` (reads only its config.json)."""
    return spec_from_hf_config(read_config_json(hf_dir), vocab_pad_multiple)


def spec_from_hf_config(cfg: dict, vocab_pad_multiple: int = 128) -> ModelSpec:
    """The `ModelSpec` for an HF config dict; `UsageError` when it is not supported."""
    architectures = cfg.get("architectures") or []
    architecture = architectures[0] if architectures else None
    family = family_of_architecture(architecture) if architecture else None
    if family is None:
        what = (f"architecture {architecture!r}" if architecture
                else "a config without 'architectures'")
        raise UsageError(f"unsupported model: {what} (supported: "
                         f"{', '.join(supported_architectures())})")
    head = LM_HEAD if architecture == family.causal_lm else SCORE_HEAD
    if head == SCORE_HEAD and _num_labels(cfg) != 1:
        raise UsageError(f"unsupported model: {architecture} with {_num_labels(cfg)} labels "
                         "(supported: a single score, num_labels=1)")
    problems = list(family.unsupported_features(cfg))
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (supported: 'silu')")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if problems:
        raise UsageError(f"unsupported {architecture} option: {'; '.join(problems)}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise UsageError(f"config.json lacks {', '.join(missing)}")
    theta, scaling = _rope(cfg)
    moe = family.moe_fields(cfg)
    if moe and not (moe["num_experts"] > 0 and 0 < moe["experts_per_token"] <= moe["num_experts"]
                    and moe["moe_intermediate_size"] > 0):
        raise UsageError(f"{architecture}: config.json needs num_experts (or num_local_experts) "
                         "> 0, 0 < num_experts_per_tok <= experts and an expert FFN size")
    heads = cfg["num_attention_heads"]
    arch = ModelArch(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # Absent means the class default, which is False for every supported family.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias(cfg),
        qk_norm=family.qk_norm(cfg),
        **moe,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        vocab_pad_multiple=vocab_pad_multiple,
    )
    return ModelSpec(arch=arch, family=family, head=head, hf_config=cfg)


def _num_labels(cfg: dict) -> int:
    if "id2label" in cfg:
        return len(cfg["id2label"])
    return int(cfg.get("num_labels", 2))


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (4.x)."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    elif "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UsageError(f"unsupported rope type {rope_type!r} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise UsageError(f"rope type {rope_type!r} needs {', '.join(missing)} in rope parameters")
    return theta, RopeScaling(rope_type=rope_type, **{k: params[k] for k in needed})
