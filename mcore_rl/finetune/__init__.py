"""The supervised and preference jobs on the Megatron train engine: SFT, reward-model
training, DPO and KTO (``train.job``), at any TP/PP/DP layout, with the RL job's
checkpoints, resume, logs and stop handling."""
from mcore_rl.finetune.jobs import FINETUNE_JOBS

__all__ = ["FINETUNE_JOBS"]

from mcore_rl.finetune import dpo, kto, online_dpo, rm, sft  # noqa: E402,F401  (they register themselves)
