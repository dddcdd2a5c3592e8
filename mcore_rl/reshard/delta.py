"""Delta sync: a rank that relays its pieces sends only the words that changed since the last sync.

After one optimizer step at an RL learning rate most weights round to the same word of the
wire dtype as before (in bf16, an update of 1e-6 against weights of 1e-2 flips the rounded
word of a few percent of them), so a sender that remembers what it sent last time can send
the positions and new values of the changed words instead of every word:

- `DeltaSender` (the rank that relays): per bucket, its pieces as one flat vector of words
  (the wire dtype's bits as an integer of the same size, compared exactly, NaN or not); the
  changed positions (int32) and their words go out, or every word (a *full* send) when it
  has no baseline, when told to, or when the delta would not be smaller;
- `DeltaReceiver` (the controller): the same flat vector per (bucket, sender), patched with
  the changes and copied into the bucket where the pieces belong.

Both keep the last-sent words of the relayed pieces: 2 bytes per relayed parameter in bf16
on the sender, and as much on the receiver. The pieces' checksums are computed by the sender
from the full new values (as without deltas) and the engine checks them before loading, so
every patched result is checked against a checksum of the full result. A sync that fails
anywhere drops every baseline (`forget`): the next one is full, as is every
``full_every``-th one.

Each message is a header (mode, count) and then the payload, over the relay's gloo group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.wire import WeightSyncError

FULL, DELTA = 0, 1
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_BYTES = 4  # int32 positions: a bucket's share holds < 2**31 words
_HEADER_BYTES = 16


def words(views: list[torch.Tensor]) -> torch.Tensor:
    """The pieces as one flat vector of integer words (a copy)."""
    if not views:
        return torch.empty(0, dtype=torch.int16)
    word = _WORDS[views[0].element_size()]
    return torch.cat([v.reshape(-1).view(word) for v in views])


@dataclass
class Traffic:
    """What the relay moved during one sync (summed over buckets and senders)."""

    nbytes: int = 0
    """Bytes sent: headers, positions and words."""
    full_nbytes: int = 0
    """What every word would have been."""
    words: int = 0
    changed: int = 0
    """Words that differed from the receiver's baseline (delta sends only)."""
    delta_words: int = 0
    """Words covered by delta sends."""

    @property
    def changed_fraction(self) -> float | None:
        return self.changed / self.delta_words if self.delta_words else None


class DeltaSender:
    """The relaying rank's side: the baseline of each bucket it sends."""

    def __init__(self) -> None:
        self.base: dict[int, torch.Tensor] = {}

    def send(self, k: int, views: list[torch.Tensor], dst: int, group, full: bool) -> None:
        new = words(views)
        base = self.base.get(k)
        changed = None
        if not full and base is not None and base.shape == new.shape:
            changed = (new != base).nonzero().view(-1).to(torch.int32)
            if changed.numel() * (_INDEX_BYTES + new.element_size()) >= new.numel() * new.element_size():
                changed = None  # no smaller than every word
        if changed is None:
            dist.send(torch.tensor([FULL, new.numel()], dtype=torch.int64), dst=dst, group=group)
            if new.numel():
                dist.send(new, dst=dst, group=group)
        else:
            dist.send(torch.tensor([DELTA, changed.numel()], dtype=torch.int64), dst=dst,
                      group=group)
            if changed.numel():
                dist.send(changed, dst=dst, group=group)
                dist.send(new[changed.long()], dst=dst, group=group)
        self.base[k] = new

    def forget(self) -> None:
        self.base.clear()


class DeltaReceiver:
    """The controller's side: the baseline of each (bucket, sender) it receives."""

    def __init__(self) -> None:
        self.base: dict[tuple[int, int], torch.Tensor] = {}

    def receive(self, k: int, src: int, views: list[torch.Tensor], group,
                traffic: Traffic) -> None:
        """Receive ``src``'s pieces of bucket k into ``views`` (the bucket, in plan order).
        A message that cannot be applied is still read to its end (the sender does not wait
        for an answer), then raised."""
        word = _WORDS[views[0].element_size()] if views else torch.int16
        total = sum(v.numel() for v in views)
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src=src, group=group)
        mode, count = int(header[0]), int(header[1])
        size = torch.empty((), dtype=word).element_size()
        traffic.words += total
        traffic.full_nbytes += _HEADER_BYTES + total * size
        problem = None
        if mode == FULL:
            flat = torch.empty(count, dtype=word)
            if count:
                dist.recv(flat, src=src, group=group)
            traffic.nbytes += _HEADER_BYTES + count * size
            if count != total:
                problem = f"rank {src} sent {count} words of bucket {k + 1}, expected {total}"
        else:
            positions = torch.empty(count, dtype=torch.int32)
            values = torch.empty(count, dtype=word)
            if count:
                dist.recv(positions, src=src, group=group)
                dist.recv(values, src=src, group=group)
            traffic.nbytes += _HEADER_BYTES + count * (_INDEX_BYTES + size)
            traffic.changed += count
            traffic.delta_words += total
            flat = self.base.get((k, src))
            if flat is None or flat.numel() != total:
                problem = (f"rank {src} sent a delta of bucket {k + 1} that this rank holds no "
                           "baseline for")
            else:
                flat[positions.long()] = values
        if problem is not None:
            self.base.pop((k, src), None)
            raise WeightSyncError(problem)
        self.base[(k, src)] = flat
        at = 0
        for v in views:
            n = v.numel()
            v.reshape(-1).view(word).copy_(flat[at:at + n])
            at += n

    def forget(self) -> None:
        self.base.clear()
