"""The multi-rank world the tests share (one per test module)."""
from mcore_rl.parallel.local_world import RankFailure, SharedWorld

__all__ = ["RankFailure", "SharedWorld"]
