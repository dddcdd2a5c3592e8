"""Several stream items handed on as one entry of the stream.

    yield Many(finished)  # in a streaming function: these items, one put for all of them

A stream entry costs an object-store put and a call to the hub whatever it holds, a few
milliseconds on a busy machine; a function that finishes many small items at once (the
asynchronous rollout: the prompt groups one engine step ended) hands them on together.
Consumers take them one by one, as if each had been put on its own: a call's
``batch_items``, the launch's ``max_in_flight`` and the stats count items, not entries. An
entry counts once against the stream's ``buffer_size``."""
from __future__ import annotations

from typing import Any, Iterable


class Many:
    """Items that go into the output stream together, in this order."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Any]):
        self.items = list(items)


def pack(items: list) -> Any:
    """One stream entry for ``items`` (at least one): a single item as itself."""
    return items[0] if len(items) == 1 else Many(items)


def unpack(entry: Any) -> list:
    """The items of one stream entry."""
    return entry.items if isinstance(entry, Many) else [entry]
