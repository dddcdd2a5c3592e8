"""Rewards: rule-based checkers, reasoning-gym scorers, user functions (``REWARDS``)."""
from mcore_rl.rewards import math_answer, reasoning_gym_reward  # noqa: F401  (registration)
from mcore_rl.rewards.registry import REWARDS, RewardError, score_all

__all__ = ["REWARDS", "RewardError", "score_all"]
