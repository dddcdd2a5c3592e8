"""A `ControllerGroup` checked and turned into what the runtime starts: one `InstanceSpec`
per controller instance (a fused chain is one instance) and the streams' sizes and
producer counts."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from mcore_rl.errors import UsageError
from mcore_rl.flow.graph import Controller, ControllerGroup, DataStream, GPUs

FEED = "<data>"
"""The stream the launch's ``data`` flows through to the source controllers."""
OWN = "<own>"
"""The input of a source that reads its own data (`Controller.data`)."""


@dataclass(frozen=True)
class StageSpec:
    """A controller fused into another's process: called in line, before it."""

    role: str
    function: Any
    batch_items: int = 1


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
    devices: tuple[int, ...] | GPUs | None
    batch_items: int
    input: str
    """A stream's name, `FEED` (the launch's data) or `OWN` (``data``, read here)."""
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
    data: Any = None
    """The source's own data (input `OWN`)."""
    max_in_flight: int | None = None
    """With its own data: at most this many items read and not yet finished by the sinks."""
    fused: tuple[StageSpec, ...] = ()
    """Controllers fused into this one, in chain order: each item passes through them first."""
    replaceable: Any = None
    """`Controller.replaceable`."""

    @property
    def name(self) -> str:
        return f"'{self.role}' #{self.index}"

    @property
    def roles(self) -> list[str]:
        """Every role this instance runs: its fused stages, then its own."""
        return [s.role for s in self.fused] + [self.role]


@dataclass(frozen=True)
class Plan:
    instances: list[InstanceSpec]
    streams: dict[str, tuple[int, int]]
    """name -> (buffer_size, number of producers); the feed has the driver as its producer."""


def build_plan(group: ControllerGroup, has_data: bool, steps: int | None,
               feed_buffer: int | None = None, max_in_flight: int | None = None,
               driven: bool = False) -> Plan:
    """Check the graph (one-line `UsageError` naming the problem) and lay out its instances.
    ``driven``: a graph a driver calls (`mcore_rl.flow.start`): no data need flow."""
    controllers = group.controllers
    if not controllers:
        raise UsageError("launch needs at least one controller")
    streams, producers, consumers = _streams(controllers)
    fed = [c for c in controllers if c.is_source and not c.reads_own_data]
    own = [c for c in controllers if c.reads_own_data]
    if fed and not has_data and not driven:
        raise UsageError(f"controller '{fed[0].role}' has no data_input and no data of its own: "
                         "launch needs data=")
    if has_data and not fed:
        raise UsageError("launch was given data but no controller is a source (no data_input)"
                         if not own else "launch was given data but every source reads its own")
    if steps is not None and steps < 1:
        raise UsageError(f"steps must be >= 1, got {steps}")
    if max_in_flight is not None and (max_in_flight < 1 or not (has_data or own)):
        raise UsageError(f"max_in_flight={max_in_flight}: give a number >= 1, and data to pace")
    if steps is None and _has_cycle(controllers):
        raise UsageError("the graph has a cycle, so its streams never end: give launch steps=")
    for c in controllers:
        if c.streaming and c.is_sink:
            raise UsageError(f"controller '{c.role}': a streaming function needs a data_output "
                             "(sinks are called per item, so steps and pacing can count them)")
    chains = _fused_chains(controllers, producers, consumers)
    inner = {c.data_output.name for chain in chains.values() for c in chain}
    device_users: Counter = Counter(d for c in controllers if isinstance(c.devices, tuple)
                                    for d in c.devices)
    indices: Counter = Counter()
    instances = []
    for c in controllers:
        if c.fused_with is not None:
            continue
        chain = chains.get(id(c), [])
        head = chain[0] if chain else c
        source_input = head.data_input.name if head.data_input is not None else \
            (OWN if head.reads_own_data else FEED)
        instances.append(InstanceSpec(
            role=c.role, index=indices[c.role], function=c.function, strategy=c.strategy,
            num_workers=c.num_workers, devices=c.devices, batch_items=c.batch_items,
            input=source_input, output=c.data_output.name if c.data_output is not None else None,
            takes_turns=isinstance(c.devices, tuple) and any(device_users[d] > 1 for d in c.devices),
            counts_steps=steps is not None and c.is_sink,
            reports_done=max_in_flight is not None and c.is_sink, streaming=c.streaming,
            data=head.data, max_in_flight=max_in_flight if head.reads_own_data else None,
            fused=tuple(StageSpec(f.role, f.function, f.batch_items) for f in chain),
            replaceable=c.replaceable))
        indices[c.role] += 1
    table = {name: (s.buffer_size, producers[name]) for name, s in streams.items()
             if name not in inner}
    if fed:
        table[FEED] = (feed_buffer or 2 * len(fed), 1)
    return Plan(instances, table)


def _streams(controllers: list[Controller]) -> tuple[dict[str, DataStream], Counter, Counter]:
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
    return streams, producers, consumers


def _fused_chains(controllers: list[Controller], producers: Counter,
                  consumers: Counter) -> dict[int, list[Controller]]:
    """id of each controller that others are fused with -> the fused controllers in chain
    order (each writes the stream the next reads; the last writes the host's input)."""
    hosts: dict[str, list[Controller]] = defaultdict(list)
    for c in controllers:
        hosts[c.role].append(c)
    chains: dict[int, list[Controller]] = {}
    for c in controllers:
        if c.fused_with is None:
            continue
        host = hosts.get(c.fused_with, [])
        if len(host) != 1 or host[0].fused_with is not None:
            raise UsageError(f"controller '{c.role}' is fused with '{c.fused_with}', which must be "
                             "one controller of the group, not fused itself")
    for host_list in hosts.values():
        host = host_list[0]
        members = [c for c in controllers if c.fused_with == host.role]
        if not members:
            continue
        chain, at = [], host
        while at.data_input is not None:
            writers = [c for c in members if c.data_output is at.data_input]
            if not writers:
                break
            if producers[at.data_input.name] != 1 or consumers[at.data_input.name] != 1:
                raise UsageError(f"stream '{at.data_input.name}' inside the fused chain of "
                                 f"'{host.role}' must have one producer and one consumer")
            at = writers[0]
            chain.insert(0, at)
        if len(chain) != len(members):
            stray = next(c for c in members if c not in chain)
            raise UsageError(f"controller '{stray.role}' is fused with '{host.role}' but does not "
                             f"lead into it: a fused chain runs each item through its controllers "
                             f"in order, ending at '{host.role}'")
        if host.batch_items != 1:
            raise UsageError(f"controller '{host.role}' has controllers fused with it, which hand "
                             f"it one item per call: batch_items={host.batch_items} needs a stream")
        chains[id(host)] = chain
    return chains


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
