"""Models: HF architectures -> Megatron-Core GPT models (actor, critic, reward model)."""
from mcore_rl.models.arch import ModelArch

__all__ = ["ModelArch"]
