"""Models: HF architectures -> Megatron-Core GPT models (actor, critic, reward model).

Entry points (none imports megatron.core until a model is built):
- `build_model(source, ctx, role)`: this rank's chunks for ``actor``/``reference``/
  ``critic``/``reward``, weights loaded from an HF directory or an mcore-rl checkpoint.
- `load_hf_spec` / `spec_from_hf_config`: HF config.json -> `ModelSpec` (or one-line error).
- `mcore_rl.models.mapping`: HF <-> Megatron tensor names and (un)fusions, pure functions.
- `mcore_rl.models.vocab.mask_padded_vocab`: mask padded logit columns before a softmax.
- `mcore_rl.models.checkpoint`: save/load mcore-rl checkpoints from running models.
"""
from mcore_rl.models.arch import ModelArch, RopeScaling
from mcore_rl.models.families import MODEL_FAMILIES, ModelFamily, register_family
from mcore_rl.models.hf_config import (LM_HEAD, SCORE_HEAD, ModelSpec, load_hf_spec,
                                       spec_from_hf_config)
from mcore_rl.models.provider import BuiltModel, build_model, check_layout, read_model_spec

__all__ = ["ModelArch", "RopeScaling", "MODEL_FAMILIES", "ModelFamily", "register_family",
           "LM_HEAD", "SCORE_HEAD", "ModelSpec", "load_hf_spec", "spec_from_hf_config",
           "BuiltModel", "build_model", "check_layout", "read_model_spec"]
