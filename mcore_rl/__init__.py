"""mcore-rl: Megatron-Core-centric RL post-training (PPO, GRPO) for large language models."""

__version__ = "0.1.0"
