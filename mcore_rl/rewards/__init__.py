"""Rewards: rule checkers, reasoning-gym scorers, sandboxed code execution, user functions
(``REWARDS``), and `RewardScorer`, which runs them over a batch (weighted, async, in worker
processes). Nothing here imports torch at module level (worker processes import it)."""
from mcore_rl.rewards import (code_execution, math_answer, reasoning_gym_reward,  # noqa: F401  (registration)
                              reward_model)
from mcore_rl.rewards.registry import (REWARDS, RewardError, RewardFailure, RewardTimeout, batched,
                                       score_all)
from mcore_rl.rewards.scorer import RewardComponent, RewardScorer

__all__ = ["REWARDS", "RewardComponent", "RewardError", "RewardFailure", "RewardScorer",
           "RewardTimeout", "batched", "score_all"]
