"""`SyncStats`: what one weight sync took and moved."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncStats:
    """Timings of one sync, measured on the controller (seconds)."""

    version: int
    buckets: int
    nbytes: int
    transfer_s: float = 0.0
    """Writers copying and checksumming their pieces, until the controller has all checksums
    (summed over buckets)."""
    apply_s: float = 0.0
    """Engines checking and loading buckets and finishing the session (summed over buckets;
    with ``overlap`` it overlaps the transfer of the next bucket)."""
    total_s: float = 0.0
    """Wall time of the whole sync."""
    per_bucket_apply_s: list[float] = field(default_factory=list)
    relayed_nbytes: int = 0
    """Bytes that trainer ranks on other nodes sent to the controller (their pieces, or with
    ``reshard.delta`` the changed words and their positions)."""
    relayed_full_nbytes: int = 0
    """What those ranks' pieces weigh in full."""
    changed_fraction: float | None = None
    """Of the words relayed as deltas, the fraction that changed (None: no delta sent)."""

    @property
    def sent_nbytes(self) -> int:
        """Bytes that reached the engines' node: the local ranks' pieces and what was relayed."""
        return self.nbytes - self.relayed_full_nbytes + self.relayed_nbytes

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s else 0.0
