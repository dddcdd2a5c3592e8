"""`Transport`: how one sync's bytes reach the engines, behind one interface.

A transport owns the memory the engines read (its ``path`` and ``nbytes``, mapped by every
engine process) and where each piece lies in it (its ``plan``). `WeightSync` drives it the
same way whatever it is:

1. ``problem(setup)`` (collective): why it cannot carry this sync, the same on every rank;
2. ``open(setup)`` (collective): set up on every trainer rank, build the plan;
3. ``on_engines_attached()``: every engine has mapped ``path`` (a file can lose its name);
4. per sync, per bucket k: ``check_sources()`` before bucket 0, then ``copies(k, views)``,
   run by the rank's `PieceWriter`, which returns their checksums, then ``deliver(k)``;
   the controller then builds the manifest from ``plan`` and hands ``buffer`` to the engines;
5. ``close()``.

A new transport is a module with a `Transport` subclass and one entry in
`mcore_rl.reshard.transports.TRANSPORTS`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from mcore_rl.models.arch import ModelArch
from mcore_rl.parallel.agreement import all_gather
from mcore_rl.reshard.plan import Holding, ReshardPlan
from mcore_rl.reshard.sources import local_holdings, parameters
from mcore_rl.reshard.writer import Copy


@dataclass
class TransportSetup:
    """What a transport is set up from: the same fields on every rank, each rank's values."""

    chunks: list
    """This rank's model chunks."""
    arch: ModelArch
    wire_dtype: torch.dtype
    """Dtype of the weights the engines read."""
    bucket_bytes: int
    """Largest bucket (an engine module larger than that gets a bucket of its own)."""
    shm_dir: str
    """Directory for files the engines map (a tmpfs)."""
    rank: int
    """This rank (global)."""
    controller: int
    """The rank that holds the engines (global)."""
    group: object | None
    """The trainer's process group (None: the default group)."""
    remote: frozenset[int] = field(default_factory=frozenset)
    """Ranks that cannot map the controller's memory (another node): they relay their pieces
    (`mcore_rl.reshard.transports.relay`)."""
    holdings: list[Holding] = field(default_factory=list)
    """What this rank holds (`local_holdings`)."""
    delta: bool = False
    """Relayed pieces travel as the words changed since the last sync (`mcore_rl.reshard.delta`)."""
    full_every: int = 10
    """With ``delta``: every N-th sync sends every word."""

    @property
    def is_remote(self) -> bool:
        return self.rank in self.remote

    def parameters(self) -> list[torch.nn.Parameter]:
        return parameters(self.chunks)

    def views(self) -> dict:
        """Fresh views of this rank's tensors by holding; not kept here, so that a transport
        that moves the parameters frees their old memory as it moves them."""
        return local_holdings(self.chunks, self.rank)[1]

    def build_plan(self, offsets: dict | None = None) -> tuple[ReshardPlan, dict]:
        """The plan from every rank's holdings (collective), and every rank's ``offsets`` (a
        transport's per-holding placement, {} when it has none) merged."""
        everyone = all_gather((self.holdings, offsets or {}), self.group)
        plan = ReshardPlan.build([h for hs, _ in everyone for h in hs], self.arch,
                                 self.bucket_bytes, self.wire_dtype)
        return plan, {h: at for _, o in everyone for h, at in o.items()}


class Transport(ABC):
    """The memory the engines read and how this rank's pieces get into it (module doc)."""

    def __init__(self, plan: ReshardPlan, path: str, nbytes: int, buffer: torch.Tensor | None):
        self.plan = plan
        """Where every piece of every bucket lies in ``buffer``."""
        self.path = path
        """What the engines map (``engine.begin_update(path, nbytes, version)``)."""
        self.nbytes = nbytes
        self.buffer = buffer
        """This rank's mapping of ``path`` (uint8 [nbytes]); None where it cannot map it."""
        self.moved_nbytes = 0
        """Bytes of the trainer's parameters that now live in ``buffer`` (not extra memory)."""

    holds_all = False
    """Every bucket stays in ``buffer`` through a sync (none reuses another's memory), so the
    engines may load them all at its end, in one call each."""

    @classmethod
    def problem(cls, setup: TransportSetup) -> str | None:
        """Why this transport cannot carry this sync (None: it can). Collective: the same
        answer on every rank. Ranks in ``setup.remote`` relay their pieces into ``buffer`` at
        their plan offsets; a transport that cannot take that says so here."""
        return None

    @classmethod
    @abstractmethod
    def open(cls, setup: TransportSetup) -> "Transport":
        """Set up on every trainer rank (collective); the plan is built here
        (`TransportSetup.build_plan`). A failure must be raised on every rank
        (`mcore_rl.parallel.agreement.raise_if_any`)."""

    def on_engines_attached(self) -> None:
        """Every engine process has mapped ``path`` (called on every rank)."""

    def check_sources(self) -> None:
        """Raise if this rank's parameters are not where the transport expects them (before
        each sync's first bucket; the error fails the sync like a failed write)."""

    @abstractmethod
    def copies(self, k: int, views: dict) -> list[Copy]:
        """This rank's writes of bucket k; ``views``: its tensors by holding
        (`mcore_rl.reshard.sources.local_holdings`). Built once per bucket and views."""

    def deliver(self, k: int) -> None:
        """After this rank's writes of bucket k (even failed ones: no rank may wait for what
        does not come): whatever makes bucket k complete on the controller."""

    def end_sync(self, ok: bool):
        """After each sync, on every rank (``ok``: it succeeded everywhere): what the
        relay moved (`mcore_rl.reshard.delta.Traffic`), or None where nothing is relayed."""
        return None

    def close(self) -> None:
        """Release this rank's resources (after every engine let go of ``path``)."""
        self.buffer = None
