"""What `launch` returns: per controller instance and per role, items and where time went."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class ControllerStats:
    """Counts and seconds of one controller instance (or, summed, of a role)."""

    role: str
    index: int = 0
    """The instance's position in its role; -1 for a role's sum."""
    instances: int = 1
    items_in: int = 0
    """Items taken from the input stream (or from the launch's data)."""
    items_out: int = 0
    """Results put into the output stream."""
    puts: int = 0
    """Entries put into the output stream: fewer than ``items_out`` where several items
    went in as one (`mcore_rl.flow.Many`)."""
    calls: int = 0
    """Function calls (a call receives ``batch_items`` items merged)."""
    busy_s: float = 0.0
    """Seconds inside the function."""
    blocked_in_s: float = 0.0
    """Seconds waiting for (and fetching) input items."""
    blocked_out_s: float = 0.0
    """Seconds handing results to the output stream, mostly waiting for room in it."""
    turn_wait_s: float = 0.0
    """Seconds waiting for a turn on devices shared with other controllers."""
    wall_s: float = 0.0
    """Seconds from the first input request to the end (a role: the longest instance)."""
    round_trips: int = 0
    """Ray round trips it waited on (`mcore_rl.flow.round_trips`): gets and fetches of its
    input, pacing waits, and its function's calls on objects other processes published."""

    _SUMMED = ("instances", "items_in", "items_out", "puts", "calls", "busy_s", "blocked_in_s",
               "blocked_out_s", "turn_wait_s", "round_trips")

    @staticmethod
    def total(role: str, parts: list["ControllerStats"]) -> "ControllerStats":
        """The sum over a role's instances (``wall_s``: the longest)."""
        out = ControllerStats(role, index=-1, instances=0)
        for part in parts:
            for name in ControllerStats._SUMMED:
                setattr(out, name, getattr(out, name) + getattr(part, name))
            out.wall_s = max(out.wall_s, part.wall_s)
        return out

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class FlowStats:
    """The result of one `launch`."""

    instances: list[ControllerStats]
    """One entry per controller instance, in the order they were added."""
    roles: dict[str, ControllerStats] = field(default_factory=dict)
    """Per role, summed over its instances."""
    steps: int = 0
    """Calls of the sink controllers (what ``steps=`` counts)."""
    wall_s: float = 0.0
    """Seconds of the whole launch, Ray start excluded."""
    lost: list[str] = field(default_factory=list)
    """Instances that failed and were replaced by the others of their role (`Replaceable`)."""
    requeued: int = 0
    """Items those instances had taken and not finished, fed again to the others."""

    @classmethod
    def collect(cls, instances: list[ControllerStats], sinks: set[str], wall_s: float) -> "FlowStats":
        roles: dict[str, list[ControllerStats]] = {}
        for s in instances:
            roles.setdefault(s.role, []).append(s)
        return cls(instances, {r: ControllerStats.total(r, parts) for r, parts in roles.items()},
                   steps=sum(s.calls for s in instances if s.role in sinks), wall_s=wall_s)

    @property
    def round_trips_per_step(self) -> float:
        """Ray round trips of all roles per step (per sink call). In a synchronous graph
        every role's work is in series, so this is a step's critical path in round trips."""
        return sum(s.round_trips for s in self.roles.values()) / self.steps if self.steps else 0.0

    def instance(self, role: str, index: int = 0) -> ControllerStats:
        """The stats of one instance of ``role``."""
        return next(s for s in self.instances if s.role == role and s.index == index)

    def table(self) -> str:
        """One line per role: items, busy and blocked seconds."""
        lines = [f"{'role':<16}{'n':>3}{'in':>7}{'out':>7}{'busy_s':>9}{'in_s':>8}{'out_s':>8}"
                 f"{'turn_s':>8}{'trips':>7}"]
        for s in self.roles.values():
            lines.append(f"{s.role:<16}{s.instances:>3}{s.items_in:>7}{s.items_out:>7}{s.busy_s:>9.2f}"
                         f"{s.blocked_in_s:>8.2f}{s.blocked_out_s:>8.2f}{s.turn_wait_s:>8.2f}"
                         f"{s.round_trips:>7}")
        return "\n".join(lines)
