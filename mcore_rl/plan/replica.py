"""One simulated engine replica: sequences stepped one token per engine step, a step's
duration set by how many run at once (the occupancy curve of the costs).

Continuous (``async``): groups join the running batch at the next step boundary whenever
there is room; a group leaves the moment its last sample ends. Static (``sync``,
``one_step_off``): a replica takes one step's groups and runs them to the end of the longest
response before taking more (sequences beyond its capacity wait for room, as in one
``generate`` call), and hands the batch on whole.

To stay fast on long responses it advances in *chunks*: between two events that change the
batch (a sample ending, a group joining, a weight sync) every step takes the same time, so
the chunk is planned whole and cut short when something happens in between. Tokens are
counted lazily: a sequence is (start step, end step) on the replica's step counter, and
``marks`` says which weight version generated which steps.

Colocated, the trainer's turn stops a replica (`request_pause`) at its next step boundary
(static: once its batch ended) until the weight sync that ends the turn.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass

from mcore_rl.plan.groups import Group

EPS = 1e-9


@dataclass
class Seq:
    group: Group
    sample: int
    start: int
    """Replica step that generates its first (kept) token."""
    end: int
    """Replica step after its last token: it ends when the step counter reaches this."""


class Replica:
    """See the module doc. ``sim`` provides the clock (``at``), the costs and the hand-offs
    (``emit``, ``synced``, ``paused``, ``offer``)."""

    def __init__(self, index: int, sim, static: bool, slowdown: float = 1.0):
        self.index, self.sim, self.static, self.slowdown = index, sim, static, slowdown
        self.costs = sim.costs
        self.running: list[tuple[int, int, Seq]] = []  # heap by end step
        self.inbox: deque[Group] = deque()  # assigned here, not started yet
        self.batch: list[Group] = []  # static: the groups of the batch being generated
        self.steps = 0
        self.version = 1
        self.marks: list[tuple[int, int]] = [(0, 1)]  # (first step, version) of each version
        self.prefill_tokens = 0.0  # charged to the next step
        self.state = "idle"  # idle | stepping | syncing | paused
        self.chunk = (0.0, 0.0, 0.0, 0)  # start, first step's seconds, step seconds, steps
        self.token = 0  # invalidates a chunk's end event when the chunk is cut short
        self.sync_to: int | None = None  # a sync waiting for the next boundary
        self.pause_asked = False  # colocated: the trainer's turn waits for this replica
        self.counter = 0

    # ----- load -----------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Sequences running or assigned here."""
        return len(self.running) + sum(g.n for g in self.inbox)

    def has_room(self, group: Group) -> bool:
        return self.load + group.n <= self.costs.max_seqs_per_replica

    def takes_batch(self) -> bool:
        """Static: free for the next step's groups (a pending sync or pause goes first)."""
        return not self.batch and self.state not in ("syncing", "paused") \
            and self.sync_to is None and not self.pause_asked

    # ----- events from outside ------------------------------------------------------------
    def wake(self, t: float) -> None:
        """Groups were assigned, or a sync or (colocated) a pause asked for: act at the next
        step boundary (if they were not taken at one already)."""
        if self.state == "idle" or (self.state == "paused" and self.sync_to is not None):
            self._next(t)
        elif self.state == "stepping" and not self.static and \
                (self.inbox or self.sync_to is not None or self.pause_asked):
            self._cut_chunk(t)

    def request_pause(self, t: float) -> None:
        """Colocated: the trainer's turn begins; stop at the next step boundary (static: once
        the batch ends) and stay stopped until the weight sync."""
        self.pause_asked = True
        self.wake(t)

    def request_sync(self, t: float, version: int) -> None:
        """New weights: applied between two steps (static: once the batch ends, since a
        ``generate`` call holds the engine's lock to its end)."""
        self.sync_to = version
        self.wake(t)

    # ----- stepping -----------------------------------------------------------------------
    def _next(self, t: float) -> None:
        if self.sync_to is not None and not (self.static and self.batch):
            self.state, self.pause_asked = "syncing", False
            self.sim.at(t + self.costs.sync_s, self._sync_end, t)
            return
        if self.pause_asked and not (self.static and self.batch):
            if self.state != "paused":
                self.state = "paused"
                self.sim.paused(t)
            return
        self.sim.offer(t, taker=self)  # room may have freed up, or the batch ended
        while self.inbox and len(self.running) + self.inbox[0].n <= self.costs.max_seqs_per_replica:
            self._start(self.inbox.popleft())
        if not self.running:
            self.state = "idle"
            return
        m = len(self.running)
        step_s = self.slowdown * self.costs.decode_step_s(m)
        first_s = step_s + self.slowdown * self.prefill_tokens / self.costs.prefill_tokens_per_s
        self.prefill_tokens = 0.0
        steps = self.running[0][0] - self.steps
        self.state, self.chunk = "stepping", (t, first_s, step_s, steps)
        self._schedule_chunk_end()

    def _start(self, group: Group, samples: list[int] | None = None) -> None:
        group.replica = self.index
        self.prefill_tokens += group.prompt_tokens  # n samples share the prompt (prefix cache)
        for j in (range(group.n) if samples is None else samples):
            self._push(Seq(group, j, self.steps, self.steps + group.lengths[j]))

    def _push(self, seq: Seq) -> None:
        self.counter += 1
        heapq.heappush(self.running, (seq.end, self.counter, seq))

    def _schedule_chunk_end(self) -> None:
        start, first_s, step_s, steps = self.chunk
        self.token += 1
        self.sim.at(start + first_s + (steps - 1) * step_s, self._chunk_end, self.token)

    def _cut_chunk(self, t: float) -> None:
        """End the chunk at the first step boundary at or after ``t``."""
        start, first_s, step_s, steps = self.chunk
        done_by_t = 1 if t <= start + first_s + EPS else \
            math.ceil((t - start - first_s) / step_s - EPS) + 1
        if done_by_t < steps:
            self.chunk = (start, first_s, step_s, done_by_t)
            self._schedule_chunk_end()

    def _chunk_end(self, t: float, token: int) -> None:
        if token != self.token:
            return  # cut short: a later event ends this chunk
        start, _, _, steps = self.chunk
        self.sim.engine_stepped(self.index, start, t, len(self.running), steps)
        self.steps += steps
        done: list[Group] = []
        while self.running and self.running[0][0] <= self.steps:
            seq = heapq.heappop(self.running)[2]
            seq.group.samples[seq.sample] = self._runs(seq.start, seq.end)
            if all(s is not None for s in seq.group.samples):
                done.append(seq.group)
        if self.static:  # the batch is handed on whole, once its longest response ended
            if self.batch and not self.running and not self.inbox:
                for group in self.batch:
                    self.sim.emit(t, group, self.version)
                self.batch = []
        else:
            for group in sorted(done, key=lambda g: g.gid):
                self._group_done(t, group)
        self._next(t)

    def _group_done(self, t: float, group: Group) -> None:
        sim = self.sim
        if sim.on_stale == "regenerate" and self.version - group.oldest_version > sim.k:
            group.regenerate(self.version)
            sim.regenerated += 1
            self.inbox.appendleft(group)
            return
        sim.emit(t, group, self.version)

    def _runs(self, start: int, end: int) -> list[tuple[int, int]]:
        """(version, tokens) of replica steps [start, end), oldest first."""
        runs = []
        i = bisect.bisect_right(self.marks, (start, math.inf)) - 1
        while i < len(self.marks) and self.marks[i][0] < end:
            lo = max(start, self.marks[i][0])
            hi = min(end, self.marks[i + 1][0]) if i + 1 < len(self.marks) else end
            if hi > lo:
                runs.append((self.marks[i][1], hi - lo))
            i += 1
        return runs

    # ----- weight sync ----------------------------------------------------------------------
    def _sync_end(self, t: float, began: float) -> None:
        self.sim.engine_synced(self.index, began, t)
        self.version, self.sync_to = self.sync_to, None
        if self.marks[-1][0] == self.steps:
            self.marks[-1] = (self.steps, self.version)  # no step ran under the previous one
        else:
            self.marks.append((self.steps, self.version))
        self._partial_rollouts()
        self.state = "idle"
        self.sim.synced(t)
        self._next(t)

    def _partial_rollouts(self) -> None:
        """Sequences mid-response: continue (their KV cache was computed with the old
        weights: prompt and tokens so far are prefilled again) or abort (start over)."""
        if self.static or not self.running:
            return
        seqs = [entry[2] for entry in self.running]
        groups = {id(s.group): s.group for s in seqs}
        self.prefill_tokens += sum(g.prompt_tokens for g in groups.values())
        if self.sim.partial == "continue":
            self.sim.partial_continued += len(seqs)
            self.prefill_tokens += sum(self.steps - s.start for s in seqs)
            return
        self.sim.partial_restarted += len(seqs)
        self.running = []
        for s in seqs:
            self._push(Seq(s.group, s.sample, self.steps, self.steps + s.group.lengths[s.sample]))
