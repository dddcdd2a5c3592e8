"""A prompt group as the simulator follows it: admitted, generated (perhaps again), scored,
then trained on or dropped; and the record of that journey in the result."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Group:
    """One prompt with its ``n`` samples on their way through the simulated graph."""

    gid: int
    """Feed position (0, 1, ...): the group's place in the synchronous order."""
    prompt_tokens: int
    lengths: list[int]
    """Each sample's response length (a restart or a regeneration draws none anew: the
    same work again, so that a what-if changes only the schedule)."""
    reward_s: float
    admitted_at: float
    samples: list[list[tuple[int, int]] | None] = field(default_factory=list)
    """Per finished sample: (weight version, tokens) runs, oldest first; None while running."""
    replica: int | None = None
    regenerations: int = 0
    regenerated_from: list[tuple[int, int]] = field(default_factory=list)
    """Per regeneration: (the replica's weight version, the group's oldest token's version)
    when it ended too old (``on_stale: regenerate``)."""
    emitted_at: float | None = None
    emitted_version: int | None = None
    """The engine's weight version when the group left it (what ``on_stale: regenerate``
    checks against)."""

    def __post_init__(self) -> None:
        self.samples = [None] * len(self.lengths)

    @property
    def n(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        """Tokens an update processes for this group: prompt + response, every sample."""
        return self.n * self.prompt_tokens + sum(self.lengths)

    @property
    def oldest_version(self) -> int:
        return min(version for runs in self.samples for version, _ in runs)

    def restart(self) -> None:
        self.samples = [None] * self.n

    def regenerate(self, engine_version: int) -> None:
        """Generate it again (too old when it ended on a replica at ``engine_version``)."""
        self.regenerated_from.append((engine_version, self.oldest_version))
        self.regenerations += 1
        self.restart()


@dataclass(frozen=True)
class GroupRecord:
    """What happened to one admitted group (`SimResult.groups`)."""

    gid: int
    replica: int | None
    admitted_at: float
    emitted_at: float | None
    emitted_version: int | None
    oldest_version: int | None
    consumed_step: int | None
    """The trainer step (1, 2, ...) that trained on it; None if dropped."""
    updated_version: int | None
    """The version the consuming batch updated (dropped groups: the one they were too old for)."""
    dropped: bool
    finished_at: float
    """When it left the graph: the end of the trainer call that took it (its step's end; at
    once for a batch with nothing left to train on). The feed's bound counts it until then."""
    regenerations: int
    token_versions: tuple[tuple[int, int], ...]
    """(version, tokens) over all its samples' response tokens (those of the generation it
    left its replica with: restarted or regenerated tokens are not in it)."""
    regenerated_from: tuple[tuple[int, int], ...] = ()
    """Per regeneration: (the replica's version, the group's oldest version) then."""

    @property
    def staleness(self) -> int | None:
        """The version its step updated (or it was dropped for) minus its oldest token's."""
        if self.updated_version is None or self.oldest_version is None:
            return None
        return self.updated_version - self.oldest_version

    @property
    def token_staleness(self) -> tuple[tuple[int, int], ...]:
        """(staleness, tokens): per response token, the version updated minus the one that
        generated it, ascending (empty while ``updated_version`` is None)."""
        if self.updated_version is None:
            return ()
        return tuple(sorted((self.updated_version - v, c) for v, c in self.token_versions))


def record_of(group: Group, consumed_step: int | None, updated_version: int,
              finished_at: float) -> GroupRecord:
    """The record of ``group``: trained on in ``consumed_step`` (None: dropped)."""
    totals: dict[int, int] = {}
    for runs in group.samples:
        for version, count in runs or []:
            totals[version] = totals.get(version, 0) + count
    return GroupRecord(group.gid, group.replica, group.admitted_at, group.emitted_at,
                       group.emitted_version, group.oldest_version if totals else None,
                       consumed_step, updated_version, consumed_step is None, finished_at,
                       group.regenerations,
                       tuple(sorted(totals.items())), tuple(group.regenerated_from))
