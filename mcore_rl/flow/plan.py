"""A `ControllerGroup` checked and turned into what the runtime starts: one `InstanceSpec`
per controller instance and the streams' sizes and producer counts."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from mcore_rl.errors import UsageError
from mcore_rl.flow.graph import ControllerGroup, DataStream

FEED = "<data>"
"""The stream the launch's ``data`` flows through to the source controllers."""


@dataclass(frozen=True)
class InstanceSpec:
    """One controller instance, as its process receives it."""

    role: str
    index: int
    """Its position among the instances of its role (0, 1, ...)."""
    function: Any
    strategy: Any
    """A name in `STRATEGIES` (or ``module:attr``), or a strategy object."""
    num_workers: int
    devices: tuple[int, ...] | None
    batch_items: int
    input: str
    output: str | None
    takes_turns: bool
    """Another instance shares one of its devices: each call waits for a turn on them."""
    counts_steps: bool
    """A sink of a launch with ``steps``: each call takes one step of the budget first."""
    reports_done: bool = False
    """A sink of a launch with ``max_in_flight``: the items each finished call consumed are
    reported to the hub."""
    streaming: bool = False
    """The function takes the input iterator and yields outputs (`Controller.streaming`)."""

    @property
    def name(self) -> str:
        return f"'{self.role}' #{self.index}"


@dataclass(frozen=True)
class Plan:
    instances: list[InstanceSpec]
    streams: dict[str, tuple[int, int]]
    """name -> (buffer_size, number of producers); the feed has the driver as its producer."""


def build_plan(group: ControllerGroup, has_data: bool, steps: int | None,
               feed_buffer: int | None = None, max_in_flight: int | None = None) -> Plan:
    """Check the graph (one-line `UsageError` naming the problem) and lay out its instances."""
    controllers = group.controllers
    if not controllers:
        raise UsageError("launch needs at least one controller")
    streams: dict[str, DataStream] = {}
    producers: Counter = Counter()
    consumers: Counter = Counter()
    for c in controllers:
        for stream in (c.data_input, c.data_output):
            if stream is not None and streams.setdefault(stream.name, stream) is not stream:
                raise UsageError(f"two different streams are named '{stream.name}'")
        if c.data_output is not None:
            producers[c.data_output.name] += 1
        if c.data_input is not None:
            consumers[c.data_input.name] += 1
    for name in streams:
        if not producers[name]:
            raise UsageError(f"stream '{name}' has consumers but no controller writes to it")
        if not consumers[name]:
            raise UsageError(f"stream '{name}' has producers but no controller reads it "
                             "(its producers would block once it is full)")
    sources = [c for c in controllers if c.is_source]
    if sources and not has_data:
        raise UsageError(f"controller '{sources[0].role}' has no data_input: launch needs data=")
    if has_data and not sources:
        raise UsageError("launch was given data but no controller is a source (no data_input)")
    if steps is not None and steps < 1:
        raise UsageError(f"steps must be >= 1, got {steps}")
    if max_in_flight is not None and (max_in_flight < 1 or not has_data):
        raise UsageError(f"max_in_flight={max_in_flight}: give a number >= 1, and data= to pace")
    if steps is None and _has_cycle(controllers):
        raise UsageError("the graph has a cycle, so its streams never end: give launch steps=")

    for c in controllers:
        if c.streaming and c.is_sink:
            raise UsageError(f"controller '{c.role}': a streaming function needs a data_output "
                             "(sinks are called per item, so steps and pacing can count them)")
    device_users: Counter = Counter(d for c in controllers for d in (c.devices or ()))
    indices: Counter = Counter()
    instances = []
    for c in controllers:
        instances.append(InstanceSpec(
            role=c.role, index=indices[c.role], function=c.function, strategy=c.strategy,
            num_workers=c.num_workers, devices=c.devices, batch_items=c.batch_items,
            input=c.data_input.name if c.data_input is not None else FEED,
            output=c.data_output.name if c.data_output is not None else None,
            takes_turns=any(device_users[d] > 1 for d in (c.devices or ())),
            counts_steps=steps is not None and c.is_sink,
            reports_done=max_in_flight is not None and c.is_sink, streaming=c.streaming))
        indices[c.role] += 1
    table = {name: (s.buffer_size, producers[name]) for name, s in streams.items()}
    if sources:
        table[FEED] = (feed_buffer or 2 * len(sources), 1)
    return Plan(instances, table)


def _has_cycle(controllers: list) -> bool:
    """Whether some stream's items can flow back into a controller that produced them."""
    readers = defaultdict(list)
    for c in controllers:
        if c.data_input is not None:
            readers[c.data_input.name].append(c)
    state: dict[int, int] = {}  # id -> 1 on the current path, 2 done

    def visit(c) -> bool:
        state[id(c)] = 1
        for nxt in readers.get(c.data_output.name, []) if c.data_output is not None else []:
            if state.get(id(nxt)) == 1 or (id(nxt) not in state and visit(nxt)):
                return True
        state[id(c)] = 2
        return False

    return any(id(c) not in state and visit(c) for c in controllers)
