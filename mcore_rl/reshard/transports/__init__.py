"""Transports of a weight sync, registered by name (``reshard.transport``), and the choice.

- ``shared`` (`shared_file`): the trainer's parameters live in the file the engines map; a
  sync only checksums them in place;
- ``buckets`` (`buckets`): every sync copies the weights into two reused buckets;
- ranks on other nodes than the engines relay their pieces to the controller (`relay`),
  around whichever transport the ranks on its node use.

A new transport is one module (a `Transport` subclass, see `base`) and one entry in
`TRANSPORTS` below; ``reshard.transport`` then takes its name (or ``module:Class``).
"""
from __future__ import annotations

import logging

from mcore_rl.registry import Registry
from mcore_rl.reshard.transports.base import Transport, TransportSetup
from mcore_rl.reshard.transports.buckets import BucketsTransport
from mcore_rl.reshard.transports.relay import RelayTransport, ranks_beside
from mcore_rl.reshard.transports.shared_file import SharedFileTransport

log = logging.getLogger(__name__)

TRANSPORTS: Registry[type[Transport]] = Registry("reshard transport")
TRANSPORTS.register("shared")(SharedFileTransport)
TRANSPORTS.register("buckets")(BucketsTransport)

AUTO = ("shared", "buckets")
"""What ``reshard.transport=auto`` tries, in order: the first one possible on every rank."""


def open_transport(requested: str, setup: TransportSetup) -> tuple[str, Transport]:
    """The transport ``requested`` (a `TRANSPORTS` name, or ``auto``), opened: its name and
    the transport. Collective; every rank decides the same, and a transport asked for by name
    that is not possible is refused on every rank with the reason. Where some ranks cannot
    map the controller's memory (``setup.remote``), they relay their pieces."""
    names = AUTO if requested == "auto" else (requested,)
    classes = [TRANSPORTS.get(name) for name in names]  # unknown: fails before any collective
    for name, cls in zip(names, classes):
        problem = cls.problem(setup)
        if problem is None:
            break
        if requested != "auto":
            raise ValueError(f"reshard.transport={name} is not possible here ({problem}); use "
                             "reshard.transport=auto, which then streams through buckets")
        if setup.rank == setup.controller:
            log.info("weight sync: not through the %s transport (%s)", name, problem)
    else:
        raise ValueError(f"no reshard transport is possible here (tried {', '.join(names)})")
    if setup.remote:
        return name, RelayTransport.open(setup, inner=cls)
    return name, cls.open(setup)


__all__ = ["AUTO", "TRANSPORTS", "BucketsTransport", "RelayTransport", "SharedFileTransport",
           "Transport", "TransportSetup", "open_transport", "ranks_beside"]
