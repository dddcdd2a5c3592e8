"""Reward functions: rule checkers, reasoning-gym scorers, user functions, bad returns."""
import pytest

from mcore_rl.rewards import REWARDS, RewardError, score_all
from mcore_rl.rewards.math_answer import extract_answer


@pytest.mark.parametrize("text, answer", [
    ("so the total is 1,234.", "1234"), ("\\boxed{-7} done 3", "-7"), ("3/4", "3/4"),
    ("no digits here", None),
])
def test_extract_answer_takes_boxed_else_last_number(text, answer):
    assert extract_answer(text) == answer


def test_math_reward_compares_numbers_not_strings():
    math = REWARDS.get("math")
    assert math("", "The answer is 0.50", {"answer": "1/2"}) == 1.0
    assert math("", "The answer is 12", {"answer": "13"}) == 0.0


def test_reasoning_gym_reward_uses_the_task_scorer():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    meta = {"entry": entry, "task": "basic_arithmetic", "answer": entry["answer"]}
    fn = REWARDS.get("reasoning_gym")
    assert fn(entry["question"], f"Let me see.\n{entry['answer']}", meta) == 1.0
    assert fn(entry["question"], "Let me see.\n123456789", meta) == 0.0


def length_reward(prompt, response, meta):
    return len(response)


def raising_reward(prompt, response, meta):
    raise KeyError("answer")


def vector_reward(prompt, response, meta):
    return [1.0, 2.0]


def test_user_function_by_dotted_path_is_called_per_sample():
    fn = REWARDS.get("tests.rewards.test_rewards:length_reward")
    assert score_all(fn, ["p", "p"], ["ab", "abcd"], [{}, {}]).tolist() == [2.0, 4.0]


def test_reward_function_that_raises_is_one_clear_error_naming_the_sample():
    with pytest.raises(RewardError, match=r"raising_reward raised KeyError: 'answer' \(sample 0"):
        score_all(raising_reward, ["p"], ["r"], [{}])


def test_reward_function_with_wrong_return_shape_is_rejected():
    with pytest.raises(RewardError, match=r"returned \[1.0, 2.0\] for sample 0; it must return one "
                                          r"finite number"):
        score_all(vector_reward, ["p"], ["r"], [{}])
    with pytest.raises(RewardError, match="returned nan"):
        score_all(lambda p, r, m: float("nan"), ["p"], ["r"], [{}])


def test_unknown_module_in_dotted_path_is_a_usage_error():
    from mcore_rl.errors import UsageError

    with pytest.raises(UsageError, match="cannot import module 'no_such_mod'"):
        REWARDS.get("no_such_mod:fn")
