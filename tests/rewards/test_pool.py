"""`WorkerPool` through `RewardScorer` with ``reward.workers``: parallel speed-up, timeouts
and dead workers cost only their own sample (until ``reward.max_failure_fraction`` of the
batch), torch-free workers."""
import sys
import time

import pytest

from mcore_rl.rewards import RewardComponent, RewardError, RewardScorer
from tests.rewards import verifiers


def scorer(fn, **options) -> RewardScorer:
    return RewardScorer([RewardComponent(fn.__name__, fn)], **options)


def _iterations_for(seconds: float) -> int:
    """Iterations of `verifiers.busy_loop` that take ``seconds`` on an idle core: the best of
    three timings, so that a burst of load while calibrating does not shorten every sample
    (and leave the pools' fixed costs a larger share of the time)."""
    n, best = 200_000, float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        verifiers.busy_loop("", "", {"n": n})
        best = min(best, time.perf_counter() - t0)
    return int(n * seconds / max(best, 1e-3))


def _stdlib_pool_scores(executor, metas) -> list[float]:
    return list(executor.map(verifiers.busy_loop, ["p"] * len(metas), ["r"] * len(metas), metas))


def test_two_workers_score_a_cpu_bound_verifier_in_at_most_0_6_of_the_serial_time():
    """8 samples of ~0.2 s of pure Python each, scored serially, by 2 of our workers and by
    2 workers of the standard library's process pool (what these 2 cores allow, measured in
    the same run), in turn; both pools are started (and warm) before the timed calls. Best
    of up to 8 rounds, so that a burst of load from other processes does not decide it.
    Ours must take at most 0.6 of the serial time, or, where this machine's cores do not
    give that (shared or busy cores), at most 1.4 times the standard pool's time; and
    always under 0.8 of the serial time. (Our pool hands a worker its next sample only when
    it answers, the standard pool queues samples ahead: on a loaded machine each of those
    round trips waits for a time slice, which came to 17% of the standard pool's time once
    and 31% in one CI run, where the serial time was 0.94 s. A pool that ran its samples
    one after the other would take twice the standard pool's time, and the serial time.)"""
    from concurrent.futures import ProcessPoolExecutor

    metas = [{"n": _iterations_for(0.2)}] * 8
    serial_s = pooled_s = stdlib_s = float("inf")
    with scorer(verifiers.busy_loop) as serial, scorer(verifiers.busy_loop, workers=2) as pooled, \
            ProcessPoolExecutor(2) as stdlib:
        pooled.score(["p"] * 2, ["r"] * 2, [{"n": 1}] * 2)  # start the pools
        _stdlib_pool_scores(stdlib, [{"n": 1}] * 2)
        for _ in range(8):
            t0 = time.perf_counter()
            expected, _ = serial.score(["p"] * 8, ["r"] * 8, metas)
            serial_s = min(serial_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            scores, _ = pooled.score(["p"] * 8, ["r"] * 8, metas)
            pooled_s = min(pooled_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            reference = _stdlib_pool_scores(stdlib, metas)
            stdlib_s = min(stdlib_s, time.perf_counter() - t0)
            assert scores.tolist() == expected.tolist() == reference
            if pooled_s <= 0.6 * serial_s:
                break
    figures = f"2 workers {pooled_s:.2f} s, standard pool {stdlib_s:.2f} s, serial {serial_s:.2f} s"
    # at most 0.6 of serial, or (where cores are shared or busy) near the standard pool
    assert pooled_s <= max(0.6 * serial_s, 1.4 * stdlib_s), figures
    assert pooled_s <= 0.8 * serial_s, figures


def test_samples_past_the_timeout_are_killed_and_score_failure_score_without_stalling():
    metas = [{"sleep": 30.0} if i in (2, 5) else {} for i in range(8)]
    with scorer(verifiers.sleepy, workers=2, timeout_s=0.5, failure_score=-1.0) as s:
        s.pool()
        t0 = time.perf_counter()
        scores, metrics = s.score(["p"] * 8, ["abc"] * 8, metas)
        wall = time.perf_counter() - t0
        after, _ = s.score(["p"] * 2, ["a", "ab"], [{}, {}])
    assert scores.tolist() == [3.0, 3.0, -1.0, 3.0, 3.0, -1.0, 3.0, 3.0]
    assert metrics["reward/timeouts"] == 2 and metrics["reward/worker_deaths"] == 0
    assert wall < 4.0, f"two 30 s samples with a 0.5 s limit took {wall:.2f} s"
    assert after.tolist() == [1.0, 2.0]


def test_a_worker_killed_by_the_os_fails_only_its_sample_and_is_replaced():
    metas = [{"die": True} if i == 3 else {} for i in range(8)]
    responses = ["x" * i for i in range(8)]
    with scorer(verifiers.dies_on_request, workers=2, failure_score=-1.0) as s:
        scores, metrics = s.score(["p"] * 8, responses, metas)
        pids = s.pool().pids()
        again, metrics_again = s.score(["p"] * 8, responses, [{}] * 8)
        assert s.pool().pids() == pids  # nothing died this time
    assert scores.tolist() == [0.0, 1.0, 2.0, -1.0, 4.0, 5.0, 6.0, 7.0]
    assert metrics["reward/worker_deaths"] == 1
    assert again.tolist() == [float(i) for i in range(8)]
    assert metrics_again["reward/worker_deaths"] == 0
    assert len(set(pids)) == 2


def test_every_fault_counts_toward_max_failure_fraction_and_a_reported_failure_does_not():
    metas = [{"fault": k} for k in ("raise", "nan", "hang", "die", "fail", "fail")] + [{}] * 2
    with scorer(verifiers.faulty, workers=2, timeout_s=1.5, failure_score=-1.0) as s:
        scores, metrics = s.score(["p"] * 8, ["r"] * 8, metas)  # 4 faults of 8: at the fraction
        assert scores.tolist() == [-1.0] * 6 + [1.0] * 2
        assert metrics["reward/errors"] == metrics["reward/nonfinite"] == 1
        assert metrics["reward/timeouts"] == metrics["reward/worker_deaths"] == 1
        assert metrics["reward/failures"] == 2
        with pytest.raises(RewardError, match=r"^reward 'faulty': 5 of 8 samples failed, more "
                                              r"than reward.max_failure_fraction=0.5 allows; the "
                                              r"first: faulty raised KeyError: 'answer' "
                                              r"\(sample 0"):
            s.score(["p"] * 8, ["r"] * 8, metas[:5] + [{"fault": "inf"}] + metas[6:])


def test_a_reward_that_hangs_on_every_sample_stops_after_the_fraction_has_timed_out():
    with scorer(verifiers.faulty, workers=2, timeout_s=1.0) as s:
        s.pool()
        t0 = time.perf_counter()
        with pytest.raises(RewardError) as err:
            s.score(["p"] * 6, ["r"] * 6, [{"fault": "hang"}] * 6)
        wall = time.perf_counter() - t0
        after, _ = s.score(["p"] * 2, ["r"] * 2, [{}, {}])
    assert str(err.value) == (
        "reward 'faulty': 4 of 6 samples failed, more than reward.max_failure_fraction=0.5 "
        "allows; the first: faulty took longer than 1 s (reward.timeout_s per sample) (sample "
        "0, response 'r'); fix the reward function or raise reward.timeout_s, or raise "
        "reward.max_failure_fraction")
    assert wall < 6.0, f"two rounds of 1 s timeouts took {wall:.2f} s"
    assert after.tolist() == [1.0, 1.0]  # the hung workers were replaced (a fresh worker
    # starts within the 1 s limit of its first sample, even on a loaded machine)


def test_batched_functions_run_in_one_chunk_per_worker():
    with scorer(verifiers.batched_length, workers=2) as s:
        scores, _ = s.score(["p"] * 5, ["a" * i for i in range(5)], [{}] * 5)
    assert scores.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_workers_do_not_import_torch():
    assert "torch" in sys.modules  # this process has it: the check below means something
    with scorer(verifiers.torch_loaded, workers=1) as s:
        scores, _ = s.score(["p"], ["r"], [{}])
        assert scores.tolist() == [0.0]
        (worker,) = s.pool().workers
    assert worker.proc.poll() is not None  # closed with the scorer
