"""`RewardScorer`: async functions in slots, weighted combinations, failure semantics, and
the config that builds it."""
import time

import pytest

from mcore_rl.config import load_config, validate_config
from mcore_rl.config.sections import RewardConfig
from mcore_rl.errors import ConfigError, UsageError
from mcore_rl.rewards import RewardComponent, RewardError, RewardScorer
from tests.rewards import verifiers

V = "tests.rewards.verifiers"


def scorer(fn, **options) -> RewardScorer:
    return RewardScorer([RewardComponent(getattr(fn, "__name__", "fn"), fn)], **options)


def test_async_verifier_scores_32_samples_eight_at_a_time():
    t0 = time.perf_counter()
    with RewardScorer.from_config(RewardConfig(name=f"{V}:slow_async", async_slots=8)) as s:
        scores, metrics = s.score(["p"] * 32, ["x" * i for i in range(32)], [{}] * 32)
    wall = time.perf_counter() - t0
    assert scores.tolist() == [float(i) for i in range(32)]
    assert wall <= 3.0, f"32 x 0.5 s in 8 slots took {wall:.2f} s"
    assert wall >= 1.9, f"took {wall:.2f} s: more than 8 samples ran at once"
    assert metrics["reward/timeouts"] == 0


def test_async_samples_past_the_timeout_score_failure_score_without_stalling():
    metas = [{"sleep": 30.0} if i in (1, 4) else {"sleep": 0.0} for i in range(6)]
    with scorer(verifiers.slow_async, timeout_s=0.3, failure_score=-1.0) as s:
        t0 = time.perf_counter()
        scores, metrics = s.score(["p"] * 6, ["ab"] * 6, metas)
        wall = time.perf_counter() - t0
    assert scores.tolist() == [2.0, -1.0, 2.0, 2.0, -1.0, 2.0]
    assert metrics["reward/timeouts"] == 2
    assert wall < 1.5, f"two 30 s samples with a 0.3 s limit stalled the batch {wall:.2f} s"


def test_weighted_rewards_sum_to_the_hand_computed_score():
    cfg = load_config(None, ["reward.weights.math=0.7", "reward.weights.exact=0.2",
                             "reward.workers=2"]).reward
    cfg.weights[f"{V}:length"] = -0.1
    cfg.weights[f"{V}:batched_length"] = 0.05
    responses = ["the answer is 12", "12", "13", "\\boxed{12}"]
    metas = [{"answer": "12"}] * 4
    with RewardScorer.from_config(cfg) as s:
        scores, metrics = s.score(["q"] * 4, responses, metas)
    math = [1.0, 1.0, 0.0, 1.0]
    exact = [0.0, 1.0, 0.0, 0.0]
    lengths = [float(len(r)) for r in responses]
    expected = [0.7 * m + 0.2 * e - 0.1 * n + 0.05 * n for m, e, n in zip(math, exact, lengths)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert metrics["reward/math/mean"] == pytest.approx(0.75)
    assert metrics["reward/exact/mean"] == pytest.approx(0.25)
    assert metrics[f"reward/{V}:length/mean"] == pytest.approx(sum(lengths) / 4)


def test_a_reported_failure_scores_failure_score_and_is_counted():
    metas = [{}, {"fail": True}, {}]
    with scorer(verifiers.fails_on_request, failure_score=-0.5) as s:
        scores, metrics = s.score(["p"] * 3, ["r"] * 3, metas)
    assert scores.tolist() == [1.0, -0.5, 1.0]
    assert metrics["reward/failures"] == 1


@pytest.mark.parametrize("fn, workers, metas, message", [
    (verifiers.raises_on_request, 0, [{}, {}, {"raise": True}, {}],
     r"^reward function raises_on_request raised KeyError: 'answer' \(sample 2, response 'r2'\)"),
    (verifiers.raises_on_request, 2, [{}, {}, {"raise": True}, {}],
     r"^reward function raises_on_request raised KeyError: 'answer' \(sample 2, response 'r2'\)"),
    (verifiers.async_raises, 0, [{}, {"raise": True}, {}, {}],
     r"^reward function async_raises raised ValueError: bad \(sample 1, response 'r1'\)"),
    (verifiers.nan_on_request, 0, [{}, {"nan": True}, {}, {}],
     r"^reward function nan_on_request returned nan for sample 1; it must return one finite"),
    (verifiers.nan_on_request, 2, [{}, {}, {}, {"nan": True}],
     r"^reward function nan_on_request returned nan for sample 3; it must return one finite"),
    (verifiers.batched_one_short, 0, [{}] * 4,
     r"^reward function batched_one_short returned 3 scores for 4 responses \(samples 0..3\)"),
    (verifiers.batched_inf_at_2, 0, [{}] * 4,
     r"^reward function batched_inf_at_2 returned inf for sample 2; it must return"),
], ids=["raises", "raises-in-pool", "async-raises", "nan", "nan-in-pool", "batched-short",
        "batched-inf"])
def test_a_buggy_reward_function_is_one_line_naming_the_sample_and_the_function(
        fn, workers, metas, message):
    with scorer(fn, workers=workers) as s, pytest.raises(RewardError, match=message) as err:
        s.score(["p"] * 4, [f"r{i}" for i in range(4)], metas)
    assert "\n" not in str(err.value)


def test_nothing_is_scored_after_a_bug():
    calls = []

    def record(prompt, response, meta):
        calls.append(response)
        return 1.0 if response != "bad" else [1.0]

    with scorer(record) as s, pytest.raises(RewardError, match="for sample 1"):
        s.score(["p"] * 4, ["a", "bad", "c", "d"], [{}] * 4)
    assert calls == ["a", "bad"]


def test_a_function_workers_cannot_import_is_refused_when_the_scorer_is_built():
    with pytest.raises(UsageError, match="cannot run in reward.workers processes: .*set "
                                         "reward.workers=0"):
        RewardScorer.from_config(RewardConfig(name=f"{__name__}:_lambda", workers=2))
    with pytest.raises(UsageError, match="both async and batched"):
        RewardScorer.from_config(RewardConfig(name=f"{__name__}:_async_batched"))


_lambda = lambda prompt, response, meta: 1.0  # noqa: E731 - a function workers cannot import


async def _async_batched(prompts, responses, metas):
    return [1.0] * len(responses)


_async_batched.reward_batched = True


@pytest.mark.parametrize("override, message", [
    ("reward.workers=-1", r"reward.workers must be >= 0, got -1; set reward.workers to a value"),
    ("reward.timeout_s=-0.5", r"reward.timeout_s must be >= 0, got -0.5"),
    ("reward.async_slots=0", r"reward.async_slots must be >= 1, got 0"),
    ("reward.weights.math=.nan", r"reward.weights.math must be a finite number"),
])
def test_bad_reward_settings_are_refused_before_any_work(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(load_config(None, [override]))
    assert "\n" not in str(err.value)


def test_an_unknown_reward_in_the_weights_names_the_key_and_the_closest_name():
    from mcore_rl.rl.job_check import check_registered_names

    cfg = load_config(None, ["reward.weights.math=1.0", "reward.weights.exatc=0.5"])
    with pytest.raises(UsageError, match=r"^reward.weights.exatc: unknown reward 'exatc'; did "
                                         r"you mean 'exact'\?"):
        check_registered_names(cfg)
