"""The ``math`` reward: answers compared as mathematics by math-verify, bounded in time."""
import signal
import threading
import time
from functools import partial

import pytest

from mcore_rl.config.sections import RewardConfig
from mcore_rl.errors import UsageError
from mcore_rl.rewards import (REWARDS, RewardComponent, RewardScorer, RewardTimeout,
                              math_verify_shim)
from mcore_rl.rewards.math_answer import extract_answer, math_reward

TOWER = "So the answer is \\boxed{9^{9^{9^{9}}}}."  # sympy works on this for hours


@pytest.mark.parametrize("response, answer", [
    ("So $\\boxed{\\frac{\\sqrt{2}}{2}}$.", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{\\frac{1}{2}} hmm, 7 pages later", "1/2"),
    ("\\boxed{\\boxed{3}}", "3"),
])
def test_nested_boxed_answer_is_read_whole(response, answer):
    assert math_reward("", response, {"answer": answer}) == 1.0


@pytest.mark.parametrize("response", ["thus \\boxed{\\dfrac{3}{4}}", "thus \\boxed{\\frac34}",
                                      "The answer is 0.75", "The answer is 3/4."])
@pytest.mark.parametrize("answer", ["\\frac{3}{4}", "0.75", "3/4"])
def test_frac_dfrac_and_decimal_are_one_answer(response, answer):
    assert math_reward("", response, {"answer": answer}) == 1.0


@pytest.mark.parametrize("response", ["Solving, $x = 3$", "x = 3", "The answer: x=3"])
def test_an_assignment_is_accepted_for_its_value(response):
    assert math_reward("", response, {"answer": "3"}) == 1.0
    assert math_reward("", response, {"answer": 3}) == 1.0


@pytest.mark.parametrize("response, answer, score", [
    ("the interval is $(1, 2]$", "(1,2]", 1.0),
    ("\\boxed{(1,2)}", "(1,2]", 0.0),
    ("$\\boxed{\\{1, 2\\}}$", "\\{2,1\\}", 1.0),
    ("$\\boxed{\\{1, 3\\}}$", "\\{2,1\\}", 0.0),
])
def test_sets_and_intervals_compare_as_sets(response, answer, score):
    assert math_reward("", response, {"answer": answer}) == score


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{\\frac{1}{3}}", "0.5"), ("The answer is 12", "13"), ("\\boxed{x^2+1}", "(x+1)^2"),
    ("\\boxed{3} or maybe \\boxed{4}", "4"),  # several boxes are a set: no hedging
])
def test_wrong_answer_scores_zero(response, answer):
    assert math_reward("", response, {"answer": answer}) == 0.0


GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("response, score", [
    ("She sold 24 in May, 48 + 24 = 72 in all.\n#### 72", 1.0),
    ("48 + 24 = 72.\n#### 72\n", 1.0),
    ("48 + 24 = 72, so \\boxed{72}", 1.0),
    # the worked solution reaches 72 but the answer line says otherwise: the line counts
    ("48 + 24 = 72, minus the 1,000 she kept.\n#### 71", 0.0),
    ("#### 70 + 2", 1.0),
    # text after the answer line holds other numbers: the line is the answer
    ("48 + 24 = 72.\n#### 72\nHope this helps with your 2 questions!", 1.0),
    ("48 + 24 = 72.\n#### 71\nThat is 1 less than 72.", 0.0),
])
def test_a_gsm8k_answer_line_is_the_answer(response, score):
    assert math_reward("", response, {"answer": GSM8K_GOLD}) == score


def test_gsm8k_thousands_separators_are_one_number():
    assert math_reward("", "so it costs\n#### 1,234", {"answer": "... #### 1234"}) == 1.0
    assert math_reward("", "\n#### 1234", {"answer": "... \n#### 1,234"}) == 1.0
    assert math_reward("", "\n#### 1,235", {"answer": "... \n#### 1,234"}) == 0.0


@pytest.mark.parametrize("response", ["I do not know.", "", "\\boxed{}", "\\boxed{3"])
def test_response_without_an_answer_scores_zero(response):
    assert math_reward("", response, {"answer": "3"}) == 0.0


def test_reference_without_an_answer_is_an_error_of_the_data():
    with pytest.raises(ValueError, match="no answer in the reference ''"):
        math_reward("", "\\boxed{3}", {"answer": ""})


def test_extract_answer_keeps_braces_nested_in_the_box():
    assert extract_answer("so \\boxed{\\frac{\\sqrt{2}}{2}} and 5") == "\\frac{\\sqrt{2}}{2}"
    assert extract_answer("\\boxed{1} then \\boxed{2") == "1"


def test_missing_math_verify_refuses_at_scorer_build_with_one_line(monkeypatch):
    monkeypatch.setattr(math_verify_shim, "available", lambda: False)
    with pytest.raises(UsageError, match=r"^reward 'math' .*pip install math-verify") as err:
        RewardScorer.from_config(RewardConfig(name="math"))
    assert "\n" not in str(err.value)


class OuterTimerFired(BaseException):
    """Not an Exception: sympy and math-verify would swallow one and go on computing."""


def test_pathological_answer_times_out_and_keeps_an_outer_timer():
    def outer(signum, frame):
        raise OuterTimerFired

    saved_handler = signal.signal(signal.SIGALRM, outer)
    saved_timer = signal.setitimer(signal.ITIMER_REAL, 20.0, 0.1)  # pytest-timeout's, if any
    try:
        started = time.monotonic()
        with pytest.raises(RewardTimeout, match="longer than 0.3 s"):
            math_reward("", TOWER, {"answer": "3"}, time_limit_s=0.3)
        assert time.monotonic() - started < 3.0
        assert signal.getsignal(signal.SIGALRM) is outer
        assert 15.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 20.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, *saved_timer)
        signal.signal(signal.SIGALRM, saved_handler)


def test_scorer_counts_a_pathological_answer_as_a_timeout_and_goes_on():
    component = RewardComponent("math", partial(math_reward, time_limit_s=0.3))
    with RewardScorer([component], failure_score=-1.0) as scorer:
        scores, metrics = scorer.score(["", ""], [TOWER, "\\boxed{3}"],
                                       [{"answer": "3"}, {"answer": "3"}])
    assert scores.tolist() == [-1.0, 1.0]
    assert metrics["reward/timeouts"] == 1


def test_scores_in_a_thread_other_than_the_main_one():
    """math-verify's own signal-based timeouts raise ValueError outside the main thread."""
    results = []
    thread = threading.Thread(target=lambda: results.append(
        math_reward("", "\\boxed{\\dfrac{1}{2}}", {"answer": "0.5"})))
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0]


def test_scores_in_reward_worker_processes():
    cfg = RewardConfig(name="math", workers=1, timeout_s=60)
    with RewardScorer.from_config(cfg) as scorer:
        scores, metrics = scorer.score(["", ""], ["\\boxed{\\frac{6}{4}}", "\\boxed{2}"],
                                       [{"answer": "1.5"}, {"answer": "3"}])
    assert scores.tolist() == [1.0, 0.0]
    assert metrics["reward/timeouts"] == 0


def test_registered_name_is_the_math_verify_reward():
    assert REWARDS.get("math") is math_reward
