"""The errors both sides of a weight sync raise: trainer ranks and engine processes."""
from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says what and in which state the engine is."""


class BucketChecksumError(WeightSyncError):
    """A piece of a bucket does not have the checksum its writer computed."""
