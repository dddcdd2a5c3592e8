"""What a user builds: streams, controllers and the group that holds them (no Ray here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from mcore_rl.errors import UsageError
from mcore_rl.registry import import_by_path


@dataclass(frozen=True, eq=False)
class DataStream:
    """A bounded FIFO of items from producer controllers to consumer controllers.

    A producer's ``put`` blocks while ``buffer_size`` items wait; each item goes to exactly
    one consumer; items keep their order per producer; when every producer has finished,
    the consumers see end-of-stream and finish. Items travel as references to Ray's object
    store, so a stream never copies a tensor."""

    name: str
    buffer_size: int = 16

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("<"):
            raise UsageError(f"stream name {self.name!r}: give a non-empty name not starting with '<'")
        if self.buffer_size < 1:
            raise UsageError(f"stream '{self.name}': buffer_size must be >= 1, got {self.buffer_size}")


@dataclass(frozen=True)
class Factory:
    """``make(*args, **kwargs)`` is called once in the controller's process; what it returns
    is called once per item (so a model or an engine is built where it runs)."""

    make: Callable[..., Callable[[Any], Any]]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def factory(make: Callable[..., Callable[[Any], Any]], *args: Any, **kwargs: Any) -> Factory:
    """A `Factory` of ``make`` called with these arguments in the controller's process."""
    return Factory(make, args, kwargs)


def build_function(function: Any) -> Callable[[Any], Any]:
    """The per-item callable of a controller's ``function``, built in the process it runs in:
    a class is instantiated (no arguments), a `Factory` is called, a ``module:attr`` string
    is imported, any other callable is used as it is."""
    if isinstance(function, str):
        function = import_by_path(function)
    if isinstance(function, Factory):
        return function.make(*function.args, **function.kwargs)
    if isinstance(function, type):
        return function()
    return function


@dataclass(frozen=True)
class GPUs:
    """``Controller.devices`` on GPU nodes: one GPU per process of the controller (per rank
    of its worker group), from a Ray placement group (`mcore_rl.flow.gpu_placement`);
    ``share``: the role whose GPUs it shares (colocated roles take turns on them)."""

    per_process: int = 1
    share: str | None = None


@dataclass(eq=False)
class Controller:
    """One role of the graph: a function applied to each item of ``data_input`` (or, for a
    source, of its own ``data`` or the launch's ``data``), its results put into
    ``data_output`` (none: a sink). Adding the same configuration twice to a group runs two
    instances."""

    role: str
    function: Any
    """A callable item -> item or None (nothing to emit), a class (instantiated once in the
    controller's process, the instance called per item), a `Factory`, or ``module:attr``."""
    data_input: DataStream | None = None
    data_output: DataStream | None = None
    num_workers: int = 1
    """Processes that run the function together (a worker group strategy); 1 for ``process``."""
    devices: Sequence[int] | GPUs | None = None
    """Cores (on CPU) this controller's processes are pinned to; controllers sharing a device
    take turns, one function call at a time. `GPUs`: a GPU per process from a placement
    group (on a Ray cluster with GPUs). None: no device, no reserved core."""
    strategy: Any = "process"
    """How the function runs: a name in `mcore_rl.flow.STRATEGIES` (``process``,
    ``worker_group``), ``module:attr``, or a strategy object such as
    ``mcore_rl.flow.Megatron(tp=2)`` (its ``world_size`` sets ``num_workers``)."""
    batch_items: int = 1
    """Items merged into one call: ``Batch.cat`` for batches, a list otherwise; the last,
    partial group at end-of-stream is delivered too."""
    data: Any = None
    """A source's own data: an iterable (or a `Factory` that builds one in the controller's
    process), read there item by item, paced by the launch's ``max_in_flight``: the items
    never pass through the driver. ``launch(group, num_epochs)`` reads it that many times."""
    fused_with: str | None = None
    """The role (a controller of the group with one instance) whose process runs this
    controller too: rank 0 of its worker group, or its process. The stream between them is
    in-process (no Ray round trip), published objects are reached directly, and this
    controller's calls happen in line with the other's (the ``fused`` placement of the RL
    graph: rollout and reward in the trainer's first rank). A fused chain leads into that
    role: each controller of it reads the stream the one before writes, or is the source."""
    streaming: bool = False
    """The function (or the object built from it) is called once, with the iterator of its
    input items (merged as ``batch_items`` says), and yields its outputs when they are
    ready: it may hold several inputs in flight and emit them in another order
    (continuous batching). Strategy ``process`` only."""
    replaceable: "Replaceable | None" = None
    """The instances of this role stand in for each other (`Replaceable`): when one fails,
    the launch goes on with the others and its unfinished items go to them. None: its
    failure ends the launch."""

    def __post_init__(self) -> None:
        if not self.role:
            raise UsageError("a controller needs a role name")
        if not (callable(self.function) or isinstance(self.function, (str, Factory))):
            raise UsageError(f"controller '{self.role}': function must be callable, a class, a "
                             f"Factory or 'module:attr', got {type(self.function).__name__}")
        if self.batch_items < 1 or self.num_workers < 1:
            raise UsageError(f"controller '{self.role}': batch_items and num_workers must be >= 1")
        if self.devices is not None and not isinstance(self.devices, GPUs):
            devices = tuple(self.devices)
            if not devices or len(set(devices)) != len(devices) or any(
                    not isinstance(d, int) or d < 0 for d in devices):
                raise UsageError(f"controller '{self.role}': devices must be distinct device ids "
                                 f"(cores on CPU), got {list(self.devices)}")
            self.devices = devices
        if not isinstance(self.strategy, str):
            if not callable(self.strategy):
                raise UsageError(f"controller '{self.role}': strategy must be a name or a strategy "
                                 f"object, got {type(self.strategy).__name__}")
            world = getattr(self.strategy, "world_size", None)
            if world is not None:
                if self.num_workers not in (1, world):
                    raise UsageError(f"controller '{self.role}': num_workers={self.num_workers} "
                                     f"conflicts with {self.strategy} ({world} ranks); leave "
                                     "num_workers out")
                self.num_workers = world
        if self.streaming and self.strategy != "process":
            raise UsageError(f"controller '{self.role}': a streaming function runs in one process "
                             f"(strategy 'process'), not {self.strategy}")
        if self.data is not None and self.data_input is not None:
            raise UsageError(f"controller '{self.role}' has both data and a data_input; a "
                             "controller with its own data is a source")
        if self.fused_with is not None and (self.num_workers != 1 or self.streaming
                                            or self.devices is not None):
            raise UsageError(f"controller '{self.role}' is fused with '{self.fused_with}': it "
                             "runs in that role's process, one worker, not streaming, with "
                             "that role's devices; drop num_workers, streaming and devices")
        if self.data_input is not None and self.data_input is self.data_output:
            raise UsageError(f"controller '{self.role}' reads and writes the same stream")
        if self.replaceable is not None and (self.data_input is not None or self.data is not None
                                             or self.fused_with is not None or self.is_sink
                                             or self.batch_items != 1):
            raise UsageError(f"controller '{self.role}' is replaceable: it reads the launch's "
                             "fed data (no data_input, no data of its own), one item per call "
                             "(batch_items=1), is not fused and has a data_output")

    @property
    def is_source(self) -> bool:
        return self.data_input is None

    @property
    def reads_own_data(self) -> bool:
        return self.data is not None

    @property
    def is_sink(self) -> bool:
        return self.data_output is None


@dataclass(frozen=True)
class Replaceable:
    """How the launch tells which items a failed instance had not finished: each fed item's
    key (``item_key(item)``, computed by the driver as it feeds), and the keys of the items
    an output finishes (``output_keys(output)``; an output that is a `Many` of several).
    Both must be picklable (module-level functions), and keys unique over the launch. The
    function must hand each item on without waiting for the end of its input (instances
    holding items wait for each other there). The role reads the launch's fed data;
    when an instance fails, a line says so, its unfinished items go back to the front of
    the feed for the other instances, and the launch fails only once none is left."""

    item_key: Callable[[Any], Hashable]
    output_keys: Callable[[Any], list]


class ControllerGroup:
    """The controllers of one launch, in the order they were added."""

    def __init__(self, controllers: Sequence[Controller] = ()):
        self.controllers: list[Controller] = []
        for controller in controllers:
            self.add(controller)

    def add(self, controller: Controller) -> Controller:
        """Add one controller instance (the same object may be added again for another)."""
        if not isinstance(controller, Controller):
            raise UsageError(f"ControllerGroup.add takes a Controller, got {type(controller).__name__}")
        self.controllers.append(controller)
        return controller

    def __len__(self) -> int:
        return len(self.controllers)
