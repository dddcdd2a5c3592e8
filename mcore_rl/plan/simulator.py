"""A discrete-event simulation, on a virtual clock, of the RL graph of ``mcore-rl train``:
prompt feed -> engine replicas -> reward -> trainer, with a weight sync after every update.

    result = simulate(costs, "async", k=2, replicas=4, steps=40)
    result.trained_tokens_per_s, result.staleness_max, result.groups_dropped

The rules are the runtime's (`mcore_rl.roles.graph`, `mcore_rl.roles.continuous`,
`mcore_rl.rl.staleness`):

- the feed admits prompt groups while fewer than (K+1)*P are unfinished: not yet through
  the trainer call that took them (the end of its step; a batch with nothing left to train
  on ends at once); ``sync`` is K=0, ``one_step_off`` K=1 with static batches (a step's
  groups spread over every replica, as one data-parallel ``generate`` call that ends with
  its longest response), ``async`` continuous batching with
  any K;
- a replica steps its sequences (`Replica`), hands a group on when all its samples ended,
  and on new weights pauses for ``sync_s``; responses in flight continue (re-prefilled) or
  restart (``partial``); ``on_stale: regenerate`` generates again a group whose oldest token
  is more than K versions behind the replica's weights when it ends;
- one reward worker scores groups in arrival order (``reward_s_per_group`` each);
- the trainer takes P groups in arrival order, drops those more than K versions older than
  the weights it updates, and updates on the rest, put back in feed order (a batch with
  nothing left is no step): ``step_overhead_s``, then the update; the step ends when every
  replica has the new weights.
  ``on_stale: regenerate`` does not stop this check: a group that ages past K in the
  queues after leaving its replica is dropped too;
- ``placement: colocated`` (engines and trainer take turns on the same devices, as
  ``rollout.placement: colocated`` runs them): the trainer's turn begins when every replica
  has stopped at a step boundary (a static replica: once its batch has ended, since a
  ``generate`` call holds the engine to its end), and lasts through the update and the
  weight sync; a continuous replica's responses in flight then go on as after any sync.
  ``separate``: the engines never wait for the trainer.

Every group trained on or dropped leaves a `GroupRecord` (``SimResult.groups``: its step or
drop, and the weight version of each of its response tokens); ``SimResult.step_records``
holds each step's groups.

The workload is ``steps`` x P groups, like a run of ``train.steps`` steps; it ends when
every group has been trained on or dropped.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from mcore_rl.errors import UsageError
from mcore_rl.plan.costs import CostModel
from mcore_rl.plan.groups import Group, GroupRecord, record_of
from mcore_rl.plan.replica import Replica
from mcore_rl.plan.result import Timeline, SimResult, summarize

SCHEDULES = ("sync", "one_step_off", "async")
PLACEMENTS = ("separate", "colocated")
MAX_EVENTS = 20_000_000
"""A guard against a simulation that never ends (a bug, not a workload)."""


@dataclass(frozen=True)
class Delays:
    """Perturbations on top of the costs (adversarial tests, what-ifs); each list is cycled."""

    response_lengths: tuple[int, ...] = ()
    """Per sample in feed order: response lengths instead of draws from the distribution."""
    reward_s: tuple[float, ...] = ()
    """Per group in feed order: reward seconds instead of ``reward_s_per_group``."""
    update_extra_s: tuple[float, ...] = ()
    """Per trainer step: seconds added to the update."""
    replica_slowdown: tuple[float, ...] = ()
    """Per replica: a factor on its step times (2: half as fast as the costs say)."""

    def __post_init__(self) -> None:
        _check_each("response_lengths", self.response_lengths, "integers >= 1",
                    lambda v: _is_int(v) and v >= 1)
        for name in ("reward_s", "update_extra_s"):
            _check_each(name, getattr(self, name), "finite numbers >= 0",
                        lambda v: _is_number(v) and v >= 0)
        _check_each("replica_slowdown", self.replica_slowdown, "finite numbers > 0",
                    lambda v: _is_number(v) and v > 0)


def _check_each(name: str, values, kind: str, ok) -> None:
    if not isinstance(values, (tuple, list)):
        raise UsageError(f"delays.{name}={values!r}: give a list of {kind}")
    for value in values:
        if not ok(value):
            raise UsageError(f"delays.{name} holds {value!r}: give {kind}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def simulate(costs: CostModel, schedule: str = "async", k: int = 1, replicas: int = 1,
             on_stale: str = "drop", partial: str = "continue", steps: int = 20, seed: int = 0,
             delays: Delays | None = None, placement: str = "separate") -> SimResult:
    """Run the graph for ``steps`` x P prompt groups; its `SimResult`."""
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if placement not in PLACEMENTS:
        raise UsageError(f"placement={placement!r}: choose one of {', '.join(PLACEMENTS)}")
    k = {"sync": 0, "one_step_off": 1}.get(schedule, k)
    if not _is_int(k) or k < 0:
        raise UsageError(f"k={k!r} must be an integer >= 0 (the max staleness)")
    if on_stale not in ("drop", "regenerate"):
        raise UsageError(f"on_stale={on_stale!r}: choose drop or regenerate")
    if partial not in ("continue", "abort"):
        raise UsageError(f"partial={partial!r}: choose continue or abort")
    if not (_is_int(replicas) and _is_int(steps)) or replicas < 1 or steps < 1:
        raise UsageError(f"replicas={replicas!r}, steps={steps!r}: both must be integers >= 1")
    if delays is not None and not isinstance(delays, Delays):
        raise UsageError(f"delays={delays!r}: give a Delays (or None)")
    sim = Simulation(costs, schedule, k, replicas, on_stale, partial, steps, seed,
                     delays or Delays(), colocated=placement == "colocated")
    sim.run()
    return summarize(sim)


class Simulation:
    """The graph's state and its event loop (see the module doc)."""

    def __init__(self, costs: CostModel, schedule: str, k: int, replicas: int, on_stale: str,
                 partial: str, steps: int, seed: int, delays: Delays, colocated: bool = False):
        self.costs, self.schedule, self.k, self.on_stale, self.partial = \
            costs, schedule, k, on_stale, partial
        self.colocated = colocated
        self.pending_pauses = 0
        self.delays, self.total = delays, steps * costs.prompts_per_step
        self.draw = costs.response_lengths.sampler(random.Random(seed))
        slow = delays.replica_slowdown
        self.replicas = [Replica(i, self, static=schedule != "async",
                                 slowdown=slow[i % len(slow)] if slow else 1.0)
                         for i in range(replicas)]
        self.events: list = []
        self.now, self.seq, self.count = 0.0, 0, 0
        self.timeline = Timeline(replicas)
        self.ready: deque[Group] = deque()  # admitted, on no replica yet
        self.admitted = self.finished = 0
        self.reward_queue: deque[Group] = deque()
        self.reward_busy = False
        self.trainer_queue: deque[Group] = deque()
        self.trainer_busy = False
        self.version = 1
        self.pending_syncs = 0
        self.batch: list[Group] = []
        """The groups the step in progress trains on, in feed order."""
        self.batch_dropped: list[Group] = []
        """Groups the step in progress dropped: finished with it (its trainer call)."""
        self.records: list[GroupRecord] = []
        """One per group trained on or dropped, as it happens (a group counted twice would
        show as two)."""
        self.regenerated = self.partial_continued = self.partial_restarted = 0
        self.empty_batches = 0

    # ----- the clock ------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def run(self) -> None:
        self._admit(0.0)
        while self.events and self.finished < self.total:
            t, _, fn, args = heapq.heappop(self.events)
            self.now = t
            fn(t, *args)
            self.count += 1
            if self.count > MAX_EVENTS:
                raise RuntimeError(f"simulation exceeded {MAX_EVENTS} events at t={t:.3f}s")
        if self.finished < self.total:
            raise RuntimeError(f"simulation stalled at t={self.now:.3f}s: {self.finished} of "
                               f"{self.total} groups finished")

    # ----- feed -----------------------------------------------------------------------------
    def _admit(self, t: float) -> None:
        """Feed groups while fewer than (K+1)*P are unfinished (the staleness bound at
        admission: the rollout runs at most K steps ahead of the trainer)."""
        window = (self.k + 1) * self.costs.prompts_per_step
        while self.admitted - self.finished < window and self.admitted < self.total:
            self.ready.append(self._new_group(t))
            self.admitted += 1
        self.offer(t)

    def _new_group(self, t: float) -> Group:
        gid, n, d = self.admitted, self.costs.n_samples, self.delays
        if d.response_lengths:
            lengths = [d.response_lengths[(gid * n + j) % len(d.response_lengths)]
                       for j in range(n)]
        else:
            lengths = [self.draw() for _ in range(n)]
        reward = d.reward_s[gid % len(d.reward_s)] if d.reward_s else self.costs.reward_s_per_group
        return Group(gid, self.costs.prompt_tokens, lengths, reward, t)

    def offer(self, t: float, taker: Replica | None = None) -> None:
        """Hand ready groups to replicas: continuous, each to the least loaded one with room;
        static, one step's groups to a free replica. ``taker`` (a replica at a step
        boundary) starts what it got itself; the others are woken."""
        woken = set()
        if self.schedule == "async":
            while self.ready:
                fits = [r for r in self.replicas if r.has_room(self.ready[0])]
                if not fits:
                    break
                replica = min(fits, key=lambda r: (r.load, r.index))
                replica.inbox.append(self.ready.popleft())
                woken.add(replica.index)
        else:
            p = self.costs.prompts_per_step
            while len(self.ready) >= p or (self.ready and self.admitted == self.total):
                if not all(r.takes_batch() for r in self.replicas):
                    break
                step = [self.ready.popleft() for _ in range(min(p, len(self.ready)))]
                for replica in self.replicas:  # one generate call over every engine (data parallel)
                    replica.batch = step[replica.index::len(self.replicas)]
                    replica.inbox.extend(replica.batch)
                    if replica.batch:
                        woken.add(replica.index)
        for i in sorted(woken):
            if taker is None or i != taker.index:
                self.at(t, self.replicas[i].wake)

    # ----- engines -> reward -> trainer -----------------------------------------------------
    def emit(self, t: float, group: Group, engine_version: int) -> None:
        group.emitted_at, group.emitted_version = t, engine_version
        self.reward_queue.append(group)
        self._score_next(t)

    def _score_next(self, t: float) -> None:
        if not self.reward_busy and self.reward_queue:
            self.reward_busy = True
            group = self.reward_queue.popleft()
            self.at(t + group.reward_s, self._scored, group)

    def _scored(self, t: float, group: Group) -> None:
        self.reward_busy = False
        self.trainer_queue.append(group)
        self._score_next(t)
        self._train_next(t)

    def _train_next(self, t: float) -> None:
        p = self.costs.prompts_per_step
        unfinished = self.admitted - self.finished
        last = self.admitted == self.total and len(self.trainer_queue) == unfinished
        if self.trainer_busy or not self.trainer_queue or (len(self.trainer_queue) < p and not last):
            return
        taken = [self.trainer_queue.popleft() for _ in range(min(p, len(self.trainer_queue)))]
        step = self.timeline.steps_done + 1
        # the consumption check (`within_staleness`), then the batch in feed order
        # (`assemble_groups`: the order the synchronous schedule gives it)
        stale = [g for g in taken if self.version - g.oldest_version > self.k]
        self.batch = sorted((g for g in taken if self.version - g.oldest_version <= self.k),
                            key=lambda g: g.gid)
        if not self.batch:  # nothing young enough: no step, no sync; the call ends at once
            self.empty_batches += 1
            self._finish(t, stale, step=None)
            self._admit(t)
            self.at(t, lambda now: self._train_next(now))
            return
        self.trainer_busy, self.batch_dropped = True, stale
        self.timeline.step_taken(t, self.batch)
        self.at(t + self.costs.step_overhead_s, self._turn)

    def _turn(self, t: float) -> None:
        """The trainer's update (after the step's fixed costs); colocated, it waits for
        every engine to stop first."""
        if self.colocated:  # the trainer's turn on the devices: every engine stops first
            self.pending_pauses = len(self.replicas)
            for replica in self.replicas:
                self.at(t, replica.request_pause)
        else:
            self._update(t)

    def paused(self, t: float) -> None:
        """Colocated: one replica has stopped; the update begins when the last one has."""
        self.pending_pauses -= 1
        if not self.pending_pauses:
            self._update(t)

    def _update(self, t: float) -> None:
        self.timeline.turn_began(t)
        step, extra = self.timeline.steps_done, self.delays.update_extra_s
        tokens = self.costs.update_tokens([g.prompt_tokens + n for g in self.batch for n in g.lengths])
        update_s = (tokens / self.costs.update_tokens_per_s
                    + self.costs.update_overhead_s + (extra[(step - 1) % len(extra)] if extra else 0.0))
        self.at(t + update_s, self._updated)

    def _updated(self, t: float) -> None:
        self.timeline.step_updated(t)
        self.pending_syncs = len(self.replicas)
        for replica in self.replicas:
            self.at(t, replica.request_sync, self.version + 1)

    def synced(self, t: float) -> None:
        """One replica has the new weights; the step ends with the last one."""
        self.pending_syncs -= 1
        if self.pending_syncs:
            return
        step = self.timeline.step_ended(t, self.version)
        self._finish(t, self.batch, step)
        self._finish(t, self.batch_dropped, step=None)
        self.version += 1
        self.trainer_busy, self.batch, self.batch_dropped = False, [], []
        self._admit(t)
        self._train_next(t)

    def _finish(self, t: float, groups: list[Group], step: int | None) -> None:
        """``groups`` leave the graph at ``t``: trained in ``step``, or dropped (None)."""
        for group in groups:
            self.records.append(record_of(group, step, self.version, t))
        self.finished += len(groups)

    # ----- what the replicas report ---------------------------------------------------------
    def engine_stepped(self, replica: int, start: float, end: float, occupancy: int,
                       steps: int) -> None:
        self.timeline.engine_busy(replica, start, end, occupancy, steps)

    def engine_synced(self, replica: int, start: float, end: float) -> None:
        self.timeline.engine_busy(replica, start, end, 0, 0)
