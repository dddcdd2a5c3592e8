"""`RewardScorer`: async functions in slots, weighted combinations, failure semantics, and
the config that builds it."""
import re
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


COUNTERS = ("reward/failures", "reward/timeouts", "reward/worker_deaths", "reward/errors",
            "reward/nonfinite")


@pytest.mark.parametrize("fn, options, metas, counter, expected", [
    (verifiers.raises_on_request, {}, [{}, {}, {"raise": True}, {}], "reward/errors",
     [1, 1, -1, 1]),
    (verifiers.raises_on_request, {"workers": 2}, [{}, {}, {"raise": True}, {}],
     "reward/errors", [1, 1, -1, 1]),
    (verifiers.async_raises, {}, [{}, {"raise": True}, {}, {}], "reward/errors", [1, -1, 1, 1]),
    (verifiers.nan_on_request, {}, [{}, {"nan": True}, {}, {}], "reward/nonfinite",
     [1, -1, 1, 1]),
    (verifiers.nan_on_request, {"workers": 2}, [{}, {}, {}, {"nan": True}], "reward/nonfinite",
     [1, 1, 1, -1]),
    (verifiers.faulty, {}, [{"fault": "inf"}, {}, {}, {}], "reward/nonfinite", [-1, 1, 1, 1]),
    (verifiers.faulty, {}, [{}, {"fault": "text"}, {}, {}], "reward/nonfinite", [1, -1, 1, 1]),
    (verifiers.batched_inf_at_2, {}, [{}] * 4, "reward/nonfinite", [1, 1, -1, 1]),
    (verifiers.slow_async, {"timeout_s": 0.2}, [{"sleep": 0.0}] * 3 + [{"sleep": 30.0}],
     "reward/timeouts", [2, 2, 2, -1]),
], ids=["raises", "raises-in-pool", "async-raises", "nan", "nan-in-pool", "inf", "text",
        "batched-inf", "async-hangs"])
def test_a_reward_fault_scores_failure_score_on_its_sample_alone_and_is_counted(
        fn, options, metas, counter, expected):
    with scorer(fn, failure_score=-1.0, **options) as s:
        scores, metrics = s.score(["p"] * 4, [f"r{i}" for i in range(4)], metas)
    assert scores.tolist() == expected
    assert metrics[counter] == 1 and sum(metrics[k] for k in COUNTERS) == 1


def test_a_batched_call_that_returns_the_wrong_number_of_scores_fails_its_whole_chunk():
    with scorer(verifiers.batched_one_short, workers=2, failure_score=-1.0,
                max_failure_fraction=1.0) as s:
        scores, metrics = s.score(["p"] * 4, [f"r{i}" for i in range(4)], [{}] * 4)
    assert scores.tolist() == [-1.0] * 4
    assert metrics["reward/errors"] == 4


@pytest.mark.parametrize("fn, options, metas, first", [
    (verifiers.raises_on_request, {}, [{"raise": True}] * 4,
     r"raises_on_request raised KeyError: 'answer' \(sample 0, response 'r0'\); fix the reward "
     r"function, or raise"),
    (verifiers.async_raises, {}, [{"raise": True}] * 4,
     r"async_raises raised ValueError: bad \(sample \d, response 'r\d'\); fix the reward function, "
     r"or raise"),
    (verifiers.nan_on_request, {"workers": 2}, [{"nan": True}] * 4,
     r"nan_on_request returned nan \(sample \d, response 'r\d'\); fix the reward function \(it "
     r"must return one finite number per response\), or raise"),
    (verifiers.slow_async, {"timeout_s": 0.2}, [{"sleep": 30.0}] * 4,
     r"slow_async took longer than 0.2 s \(reward.timeout_s\) \(sample \d, response 'r\d'\); fix "
     r"the reward function or raise reward.timeout_s, or raise"),
    (verifiers.batched_one_short, {}, [{}] * 4,
     r"batched_one_short returned 3 scores for 4 responses \(batched call on samples 0..3\); fix "
     r"the reward function \(a batched function returns one finite number per response, in "
     r"order\), or raise"),
], ids=["raises", "async-raises", "nan-in-pool", "async-hangs", "batched-short"])
def test_a_reward_failing_on_most_samples_stops_in_one_line_naming_the_reward_cause_and_fix(
        fn, options, metas, first):
    with scorer(fn, **options) as s, pytest.raises(RewardError) as err:
        s.score(["p"] * 4, [f"r{i}" for i in range(4)], metas)
    line = str(err.value)
    assert re.match(rf"reward '{fn.__name__}': [34] of 4 samples failed, more than "
                    r"reward.max_failure_fraction=0.5 allows; the first: ", line), line
    assert re.search(first, line), line
    assert line.endswith(", or raise reward.max_failure_fraction") and "\n" not in line


@pytest.mark.parametrize("fraction, n, faults, stops", [
    (0.5, 8, 4, False), (0.5, 8, 5, True), (0.3, 10, 3, False), (0.3, 10, 4, True),
    (0.0, 4, 0, False), (0.0, 4, 1, True), (1.0, 4, 4, False),
])
def test_scoring_stops_above_max_failure_fraction_and_not_at_or_below_it(fraction, n, faults,
                                                                         stops):
    kinds = ["raise", "nan", "inf", "text"] * 3
    metas = [{"fault": k} for k in kinds[:faults]] + [{}] * (n - faults)
    with scorer(verifiers.faulty, failure_score=-1.0, max_failure_fraction=fraction) as s:
        if stops:
            with pytest.raises(RewardError, match=rf"^reward 'faulty': {faults} of {n} samples "
                                                  r"failed, .*the first: faulty raised KeyError: "
                                                  r"'answer' \(sample 0, "):
                s.score(["p"] * n, ["r"] * n, metas)
            return
        scores, metrics = s.score(["p"] * n, ["r"] * n, metas)
    assert scores.tolist() == [-1.0] * faults + [1.0] * (n - faults)
    assert metrics["reward/errors"] + metrics["reward/nonfinite"] == faults


def test_reported_failures_do_not_count_toward_max_failure_fraction():
    with scorer(verifiers.fails_on_request, failure_score=-1.0, max_failure_fraction=0.0) as s:
        scores, metrics = s.score(["p"] * 4, ["r"] * 4, [{"fail": True}] * 4)
    assert scores.tolist() == [-1.0] * 4 and metrics["reward/failures"] == 4


def test_max_failure_fraction_comes_from_the_config_and_is_one_half_by_default():
    assert RewardConfig().max_failure_fraction == 0.5
    cfg = RewardConfig(name=f"{V}:faulty", max_failure_fraction=0.0)
    with RewardScorer.from_config(cfg) as s, pytest.raises(RewardError, match=r"^reward "
                                                           rf"'{V}:faulty': 1 of 2 samples"):
        s.score(["p"] * 2, ["r"] * 2, [{}, {"fault": "nan"}])


@pytest.mark.parametrize("fraction, calls_made", [(0.25, 3), (0.0, 1)])
def test_nothing_more_is_scored_once_the_batch_is_past_max_failure_fraction(fraction, calls_made):
    calls = []

    def record(prompt, response, meta):
        calls.append(response)
        return [1.0]

    with scorer(record, max_failure_fraction=fraction) as s, \
            pytest.raises(RewardError, match=rf"^reward 'record': {calls_made} of 8 samples"):
        s.score(["p"] * 8, list("abcdefgh"), [{}] * 8)
    assert calls == list("abcdefgh"[:calls_made])


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
    ("reward.max_failure_fraction=1.5",
     r"reward.max_failure_fraction must be in \[0, 1\], got 1.5; set .* \(0 stops at the first"),
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
