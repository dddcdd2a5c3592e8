"""reasoning-gym tasks scored by their own scorers (PyPI ``reasoning-gym``, offline)."""
from __future__ import annotations

from functools import lru_cache

from mcore_rl.errors import UsageError
from mcore_rl.rewards.registry import REWARDS


@lru_cache(maxsize=None)
def _scorer(task: str):
    try:
        import reasoning_gym
    except ImportError:
        raise UsageError("reward 'reasoning_gym' needs the reasoning-gym package: "
                         "pip install reasoning-gym") from None
    return reasoning_gym.get_score_answer_fn(task)


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(prompt: str, response: str, meta: dict) -> float:
    """The task's own score of the response (``meta["entry"]`` is the dataset record,
    ``meta["task"]`` its task name), applied to the final answer line."""
    from mcore_rl.rewards.math_answer import extract_answer

    entry = meta["entry"]
    answer = response.strip().splitlines()[-1] if response.strip() else ""
    score = _scorer(meta["task"])(answer, entry)
    if not score and extract_answer(response) is not None:
        score = _scorer(meta["task"])(extract_answer(response), entry)
    return float(score)
