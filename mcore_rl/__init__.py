"""mcore-rl: Megatron-Core-centric RL post-training (PPO, GRPO) for large language models.

``from mcore_rl import RLTrainer``: the Python API (`mcore_rl.api`), loaded on first use."""
import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    # By name, not an import statement: every package reaches this one (e.g. through
    # `mcore_rl.kernels`), and the root must not pull the top layer into the layers below.
    if name in ("RLTrainer", "Rollouts"):
        return getattr(importlib.import_module("mcore_rl.api"), name)
    raise AttributeError(f"module 'mcore_rl' has no attribute {name!r}")
