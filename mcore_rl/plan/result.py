"""What a simulation reports (`SimResult`), and the timeline it is computed from.

Rates and fractions are *steady-state*: measured between the end of step ``warmup`` (the
pipeline filling: K+1 steps) and the end of the last step before the ``drain`` (the last K
steps, which lack the work of steps that never come), on at most a quarter of the steps
each. Staleness counts every consumed group.

``groups``, ``step_records`` and ``engine_busy`` hold the run's detail
(``to_dict(detail=True)``): what happened to every group, which groups each step trained
on, and when each engine ran.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mcore_rl.plan.groups import Group, GroupRecord


@dataclass
class StepRecord:
    step: int
    taken_at: float
    groups: tuple[int, ...]
    tokens: int
    turn_at: float = 0.0
    """When its update began: after ``step_overhead_s`` and, colocated, once every engine
    had stopped."""
    updated_at: float = 0.0
    ended_at: float = 0.0
    version: int = 0
    """The weight version this step updated (its groups' staleness is measured to it)."""


class Timeline:
    """Busy intervals of the engines and the trainer's steps, as they happen."""

    def __init__(self, replicas: int):
        self.engine: list[list[tuple[float, float, int, int]]] = [[] for _ in range(replicas)]
        self.steps: list[StepRecord] = []

    @property
    def steps_done(self) -> int:
        return len(self.steps)

    def engine_busy(self, replica: int, start: float, end: float, occupancy: int,
                    steps: int) -> None:
        """``steps`` engine steps at ``occupancy`` (0, 0: a weight sync) over [start, end]."""
        self.engine[replica].append((start, end, occupancy, steps))

    def step_taken(self, t: float, batch: list[Group]) -> None:
        self.steps.append(StepRecord(len(self.steps) + 1, t, tuple(g.gid for g in batch),
                                     sum(g.tokens for g in batch)))

    def turn_began(self, t: float) -> None:
        self.steps[-1].turn_at = t

    def step_updated(self, t: float) -> None:
        self.steps[-1].updated_at = t

    def step_ended(self, t: float, version: int) -> int:
        self.steps[-1].ended_at, self.steps[-1].version = t, version
        return self.steps[-1].step


@dataclass
class SimResult:
    """One simulated run (see the module doc for the steady-state window)."""

    schedule: str
    k: int
    replicas: int
    on_stale: str
    partial: str
    trained_tokens_per_s: float
    """Prompt + response tokens of trained samples per second."""
    step_time_s: float
    """Mean seconds per step."""
    staleness_mean: float
    """Per consumed group: the version it updated minus its oldest token's."""
    staleness_max: int
    token_staleness_mean: float
    """Per consumed response token: the version it updated minus the token's."""
    token_staleness_max: int
    engine_occupancy: float
    """Mean sequences in flight per engine step."""
    engine_idle_fraction: float
    """Time the engines were not stepping or syncing, averaged over replicas: nothing to run,
    or (colocated) stopped for the trainer's turn."""
    trainer_idle_fraction: float
    """Time the trainer waited for groups: it is busy from taking a batch to the end of its
    sync (colocated, waiting for the engines to stop counts as busy)."""
    groups_admitted: int
    groups_trained: int
    groups_dropped: int
    groups_regenerated: int
    """Regenerations (a group regenerated twice counts twice)."""
    partial_continued: int
    partial_restarted: int
    empty_batches: int
    """Batches in which every group was too stale: no step."""
    steps: int
    total_time_s: float
    window_s: tuple[float, float]
    step_times_s: list[float]
    """Seconds from the end of the step before (0 for the first) to the end of each step."""
    step_records: list[StepRecord] = field(repr=False)
    """Per step: when it took its batch, its groups (feed order), when it updated and ended."""
    groups: list[GroupRecord] = field(repr=False)
    """Per admitted group, by ``gid``: trained (``consumed_step``) or ``dropped``, with the
    weight version of its response tokens (``token_staleness``)."""
    engine_busy: list[list[tuple[float, float, int, int]]] = field(default_factory=list, repr=False)
    """Per replica: (start, end, occupancy, engine steps) of each stretch of steps, and
    (start, end, 0, 0) of each weight sync."""

    def to_dict(self, detail: bool = False) -> dict:
        """Plain data (JSON); ``detail`` adds the per-step and per-group records."""
        out = asdict(self)
        if not detail:
            del out["step_records"], out["groups"], out["engine_busy"]
        return out


def summarize(sim) -> SimResult:
    steps = sim.timeline.steps
    n = len(steps)
    warm, tail = min(sim.k + 1, n // 4), min(sim.k, n // 4)
    inside = steps[warm:n - tail]
    start = steps[warm - 1].ended_at if warm else 0.0
    end = inside[-1].ended_at
    span = max(end - start, 1e-12)
    groups = sorted(sim.records, key=lambda g: (g.gid, g.dropped, g.consumed_step or 0))
    trained = [g for g in groups if not g.dropped]
    stale = [g.staleness for g in trained]
    token_stale = [(g.updated_version - v, c) for g in trained for v, c in g.token_versions]
    tokens = sum(c for _, c in token_stale)
    busy, stepped, occupied = 0.0, 0.0, 0.0
    for intervals in sim.timeline.engine:
        for a, b, occ, count in intervals:
            part = _overlap(a, b, start, end)
            busy += part
            if count and b > a:
                stepped += count * part / (b - a)
                occupied += occ * count * part / (b - a)
    trainer_busy = sum(_overlap(s.taken_at, s.ended_at, start, end) for s in steps)
    ends = [0.0] + [s.ended_at for s in steps]
    return SimResult(
        schedule=sim.schedule, k=sim.k, replicas=len(sim.replicas), on_stale=sim.on_stale,
        partial=sim.partial,
        trained_tokens_per_s=sum(s.tokens for s in inside) / span,
        step_time_s=span / len(inside),
        staleness_mean=sum(stale) / len(stale) if stale else 0.0,
        staleness_max=max(stale, default=0),
        token_staleness_mean=sum(s * c for s, c in token_stale) / tokens if tokens else 0.0,
        token_staleness_max=max((s for s, _ in token_stale), default=0),
        engine_occupancy=occupied / stepped if stepped else 0.0,
        engine_idle_fraction=max(0.0, 1.0 - busy / (span * len(sim.replicas))),
        trainer_idle_fraction=max(0.0, 1.0 - trainer_busy / span),
        groups_admitted=sim.admitted, groups_trained=len(trained),
        groups_dropped=len(groups) - len(trained), groups_regenerated=sim.regenerated,
        partial_continued=sim.partial_continued, partial_restarted=sim.partial_restarted,
        empty_batches=sim.empty_batches, steps=n, total_time_s=sim.now,
        window_s=(start, end), step_times_s=[b - a for a, b in zip(ends, ends[1:])],
        step_records=steps, groups=groups, engine_busy=sim.timeline.engine)


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))
