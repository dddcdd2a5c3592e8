"""Multi-turn environments: rollouts that alternate engine turns and environment turns
(``ENVIRONMENTS``; ``environment.name`` in the config)."""
from mcore_rl.envs import calculator  # noqa: F401  (registration)
from mcore_rl.envs.base import ENVIRONMENTS, Environment, EnvStep

__all__ = ["ENVIRONMENTS", "Environment", "EnvStep"]
