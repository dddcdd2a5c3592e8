"""`RewardScorer`: the config's reward functions over a batch of responses, at scale.

- Several functions combine as a weighted sum (``reward.weights``); each one's mean is
  reported as ``reward/<name>/mean``.
- ``async def`` functions run concurrently in an event loop of this process, at most
  ``reward.async_slots`` samples at once.
- Synchronous functions run in ``reward.workers`` worker processes (`WorkerPool`; a batched
  function in one chunk per worker), or with 0 in this process, one call after another.
- ``reward.timeout_s`` bounds each sample (async functions and the pool; a function called
  in this process cannot be interrupted).
- A response the function cannot score (it raises `RewardFailure`, e.g. a program that
  crashes, or `RewardTimeout`) scores ``reward.failure_score`` and is counted
  (``reward/failures``, ``reward/timeouts``: samples per batch).
- A fault of the reward itself costs only its sample too (``reward.failure_score``) and is
  counted: a call past ``reward.timeout_s`` (``reward/timeouts``), whose worker process
  died (``reward/worker_deaths``), that raised anything else or (batched) returned the
  wrong number of scores (``reward/errors``), a score that is not a finite number
  (``reward/nonfinite``). Once more than ``reward.max_failure_fraction`` of a batch's
  samples have failed by faults of one function, scoring stops (nothing more is sent):
  `RewardError`, one line naming the reward, the count, the first fault and the fix.

The pool and the event loop start with the first batch that needs them and live until
`close`.
"""
from __future__ import annotations

import asyncio
import inspect
import pickle
import threading
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

from mcore_rl.errors import UsageError
from mcore_rl.rewards.outcome import FAULTS, Outcome, call, call_async
from mcore_rl.rewards.pool import WorkerPool
from mcore_rl.rewards.registry import REWARDS, RewardError, function_name, is_batched

if TYPE_CHECKING:
    import torch

    from mcore_rl.config.sections import RewardConfig

COUNTERS = {"failure": "reward/failures", "timeout": "reward/timeouts",
            "overtime": "reward/timeouts", "died": "reward/worker_deaths",
            "raised": "reward/errors", "length": "reward/errors", "invalid": "reward/nonfinite"}
"""Outcome kind -> the metric that counts its samples."""


@dataclass(frozen=True)
class RewardComponent:
    """One reward function of a scorer and its weight in the sum."""

    name: str
    fn: Callable
    weight: float = 1.0

    @property
    def kind(self) -> str:
        """``async``, ``batched`` or ``sample`` (synchronous, per sample)."""
        inner = self.fn.func if isinstance(self.fn, partial) else self.fn
        if inspect.iscoroutinefunction(inner):
            return "async"
        return "batched" if is_batched(self.fn) else "sample"


def build_component(name: str, weight: float, cfg: RewardConfig) -> RewardComponent:
    """The registered (or ``module:function``) reward ``name``, prepared for ``cfg``."""
    entry = REWARDS.entry(name)
    fn = entry.obj
    prepare = entry.meta.get("prepare")
    if prepare is not None:
        fn = prepare(fn, cfg)
    component = RewardComponent(name, fn, weight)
    if component.kind == "async" and is_batched(fn):
        raise UsageError(f"reward '{name}': {function_name(fn)} is both async and batched; make "
                         "it a per-sample async def, or a synchronous batched function")
    if cfg.workers and component.kind != "async":
        _check_sendable(name, fn)
    return component


def _check_sendable(name: str, fn: Callable) -> None:
    """Worker processes import the function by module and name."""
    inner = fn.func if isinstance(fn, partial) else fn
    problem = None
    if getattr(inner, "__module__", None) == "__main__":
        problem = "it is defined in the __main__ script"
    else:
        try:
            pickle.dumps(fn)
        except Exception as err:  # noqa: BLE001 - lambdas, nested functions, closures
            problem = f"it cannot be pickled by reference ({type(err).__name__})"
    if problem:
        raise UsageError(f"reward '{name}' cannot run in reward.workers processes: {problem}; "
                         "define it at module level in an importable module, or set reward.workers=0")


class RewardScorer:
    """Scores batches with weighted reward functions (see the module docstring)."""

    def __init__(self, components: Sequence[RewardComponent], *, workers: int = 0,
                 async_slots: int = 8, timeout_s: float = 0.0, failure_score: float = 0.0,
                 max_failure_fraction: float = 0.5):
        if not components:
            raise UsageError("a reward scorer needs at least one reward function")
        self.components = list(components)
        self.workers, self.async_slots = workers, async_slots
        self.timeout_s, self.failure_score = timeout_s, failure_score
        self.max_failure_fraction = max_failure_fraction
        self._pool: WorkerPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardScorer:
        """``reward.weights`` (or ``reward.name`` alone), each function resolved and
        prepared now, so a reward that cannot run refuses before any work."""
        weights = cfg.weights or {cfg.name: 1.0}
        components = [build_component(name, w, cfg) for name, w in weights.items()]
        return cls(components, workers=cfg.workers, async_slots=cfg.async_slots,
                   timeout_s=cfg.timeout_s, failure_score=cfg.failure_score,
                   max_failure_fraction=cfg.max_failure_fraction)

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              metas: Sequence[dict]) -> tuple[torch.Tensor, dict[str, float]]:
        """[B] float32 weighted scores and the batch's metrics (``reward/<name>/mean`` per
        function; the counts of `COUNTERS`); `RewardError` past ``max_failure_fraction``."""
        import torch

        n = len(responses)
        if not len(prompts) == n == len(metas):
            raise RewardError(f"a batch to score has {len(prompts)} prompts, {n} responses and "
                              f"{len(metas)} metas; give one of each per response")
        args = list(zip(prompts, responses, metas))
        total = [0.0] * n
        metrics = dict.fromkeys(COUNTERS.values(), 0.0)
        if not n:
            return torch.zeros(0, dtype=torch.float32), metrics
        for c in self.components:
            values = self._values(c, args, metrics)
            total = [t + c.weight * v for t, v in zip(total, values)]
            metrics[f"reward/{c.name}/mean"] = sum(values) / n
        return torch.tensor(total, dtype=torch.float32), metrics

    def _values(self, c: RewardComponent, args: list[tuple], metrics: dict) -> list[float]:
        """One score per sample of component ``c`` (``failure_score`` where none); failed
        samples counted in ``metrics``."""
        spans = self._run(c, args)
        values = [self.failure_score] * len(args)
        faults, first = 0, None
        for start, stop, outcome in spans:
            if outcome is None:
                continue  # not run: the batch was past max_failure_fraction already
            if isinstance(outcome.value, list):  # a batched call's, None where not a number
                values[start:stop] = [self.failure_score if v is None else v for v in outcome.value]
            elif outcome.kind == "ok":
                values[start] = outcome.value
            if outcome.kind == "ok":
                continue
            metrics[COUNTERS[outcome.kind]] += outcome.unscored(stop - start)
            if outcome.kind in FAULTS:
                faults += outcome.faults(stop - start)
                first = first or (start, stop, outcome)
        if self._past_limit(faults, len(args)):
            raise RewardError(self._stop_message(c, faults, len(args), *first, args))
        if any(o is None for _, _, o in spans):
            raise RuntimeError("reward calls were abandoned below reward.max_failure_fraction")
        return values

    def _past_limit(self, faults: int, n: int) -> bool:
        return faults / n > self.max_failure_fraction

    def _run(self, c: RewardComponent, args: list[tuple]) -> list[tuple[int, int, Outcome | None]]:
        """(first sample, end, outcome) of every call of ``c`` over the batch; None for the
        calls never run (or abandoned) once the batch was past ``max_failure_fraction``."""
        faults = 0

        def stop(size: int, outcome: Outcome) -> bool:
            nonlocal faults
            faults += outcome.faults(size)
            return self._past_limit(faults, len(args))

        if c.kind == "async":
            outcomes = self._event_loop_run(self._gather(c.fn, args, stop))
            return [(i, i + 1, o) for i, o in enumerate(outcomes)]
        if c.kind == "batched":
            chunks = _chunks(len(args), max(1, self.workers))
            tasks = [(c.fn, tuple(map(list, zip(*args[a:b]))), b - a) for a, b in chunks]
            timeouts = [self.timeout_s * (b - a) for a, b in chunks]
        else:
            chunks = [(i, i + 1) for i in range(len(args))]
            tasks = [(c.fn, a, None) for a in args]
            timeouts = [self.timeout_s] * len(args)
        if self.workers:
            outcomes = self.pool().run(tasks, timeouts,
                                       lambda i, o: stop(chunks[i][1] - chunks[i][0], o))
        else:
            outcomes = []
            for (a, b), task in zip(chunks, tasks):
                outcomes.append(call(*task))
                if stop(b - a, outcomes[-1]):
                    break
            outcomes += [None] * (len(tasks) - len(outcomes))
        return [(a, b, o) for (a, b), o in zip(chunks, outcomes)]

    async def _gather(self, fn: Callable, args: list[tuple],
                      stop: Callable[[int, Outcome], bool]) -> list[Outcome | None]:
        slots = asyncio.Semaphore(self.async_slots)

        async def one(a: tuple) -> Outcome:
            async with slots:
                return await call_async(fn, a, self.timeout_s)

        tasks = [asyncio.ensure_future(one(a)) for a in args]
        try:
            for next_done in asyncio.as_completed(tasks):
                if stop(1, await next_done):
                    break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [t.result() if not t.cancelled() else None for t in tasks]

    def _stop_message(self, c: RewardComponent, faults: int, n: int, start: int, stop: int,
                      o: Outcome, args: list[tuple]) -> str:
        """One line: the reward, how many samples failed, the first fault, the fix."""
        i = start + o.offset
        where = f"sample {i}, response {args[i][1][:60]!r}" if stop - start == 1 or \
            o.kind == "invalid" else f"batched call on samples {start}..{stop - 1}"
        fix = {"overtime": "fix the reward function or raise reward.timeout_s",
               "invalid": "fix the reward function (it must return one finite number per "
                          "response)",
               "length": "fix the reward function (a batched function returns one finite "
                         "number per response, in order)"}.get(o.kind, "fix the reward function")
        return (f"reward '{c.name}': {faults} of {n} samples failed, more than "
                f"reward.max_failure_fraction={self.max_failure_fraction:g} allows; the first: "
                f"{function_name(c.fn)} {o.message} ({where}); {fix}, or raise "
                "reward.max_failure_fraction")

    def pool(self) -> WorkerPool:
        """The worker pool (started on first use)."""
        if self._pool is None:
            self._pool = WorkerPool(self.workers)
        return self._pool

    def _event_loop_run(self, coro):
        """Run ``coro`` in the scorer's event loop, a thread of its own (so that it works
        whether or not the caller runs a loop, and async clients live across batches)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever,
                                                 name="reward-event-loop", daemon=True)
            self._loop_thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Stop the worker pool and the event loop; the scorer may start them again."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()
            self._loop.close()
            self._loop = self._loop_thread = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``min(parts, n)`` contiguous chunks of ``range(n)``, near equal."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]
