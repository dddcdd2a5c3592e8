"""The numbers of a model that decide which layouts and lengths can run: from the model's
``config.json`` when the run names a checkpoint, else from the run's inline architecture."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mcore_rl.errors import ConfigError, UsageError


@dataclass(frozen=True)
class ModelShape:
    """What the layout checks need to know about the model."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model."""
    moe_intermediate_size: int = 0


def model_shape(model: Any) -> ModelShape:
    """The shape of the run's model (a ``ModelConfig``: ``model.path``, or its inline fields)."""
    if not model.path:
        return ModelShape(model.num_layers, model.num_attention_heads, model.num_kv_heads,
                          model.max_position_embeddings, model.num_experts,
                          model.moe_intermediate_size if model.num_experts else 0)
    from mcore_rl.models.builtin import resolve_model_path
    from mcore_rl.models.hf_config import spec_from_hf_config

    model_dir = resolve_model_path(model.path)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path: '{model.path}' has no config.json; point it at a "
                          "HuggingFace checkpoint directory or a `mcore-rl convert hf-to-mcore` "
                          "output")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"model.path: {config_file} is not valid JSON ({err.msg} at line "
                          f"{err.lineno}); fix or replace the file") from None
    try:
        arch = spec_from_hf_config(hf).arch
    except UsageError as err:
        raise ConfigError(f"model.path: {model.path}: {err}") from None
    return ModelShape(arch.num_layers, arch.num_attention_heads, arch.num_kv_heads,
                      arch.max_position_embeddings, arch.num_experts, arch.moe_intermediate_size)
