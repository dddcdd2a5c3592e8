"""RL math in pure torch: advantage estimators, policy/value losses, KL (registries)."""
from mcore_rl.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, needs_critic
from mcore_rl.algos.kl import KLController, kl_per_token
from mcore_rl.algos.losses import POLICY_LOSSES, aggregate

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "needs_critic", "KLController",
           "kl_per_token", "POLICY_LOSSES", "aggregate"]
