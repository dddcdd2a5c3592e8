"""The dataflow runtime: controllers connected by streams, run as Ray actors.

A `DataStream` is a bounded FIFO of items (a dict, a `mcore_rl.data.batch.Batch`, any
picklable value); items travel as references into Ray's shared-memory object store. A
`Controller` is a role with a function ``item -> item or None``: it reads its
``data_input`` (none: a source, fed the items of ``launch``'s ``data``) and writes what
the function returns to its ``data_output`` (none: a sink). A `ControllerGroup` holds
the instances of one graph; `launch` starts each instance in a process of its own (or, by
its ``strategy``, in a group of processes), runs them until the data or the ``steps``
budget is used up, and returns `FlowStats`::

    rollout = DataStream("rollout", buffer_size=4)
    group = ControllerGroup()
    group.add(Controller(role="actor", data_output=rollout, function=generate, devices=[0]))
    group.add(Controller(role="trainer", data_input=rollout, function=Trainer, batch_items=2))
    stats = launch(group, data=prompt_batches, num_epochs=3)

A source may read its own data (``Controller(..., data=dataset)``): ``launch(group,
num_epochs)`` then reads it in the source's process, paced by ``max_in_flight``. A
controller may be fused into another (``fused_with``): it runs in that one's process (its
first rank), in line, with no stream and no Ray round trip between them. ``start(group)``
starts a graph for a driver that calls its controllers itself (`RunningGraph.call`).

A function that finishes several small items at once may hand them on as one entry
(`Many`: one object-store put and one call for all of them); consumers take its items one
by one. Backpressure: a producer blocks once ``buffer_size`` entries wait in its output,
so a fast role runs at most that far ahead of a slow one. End-of-stream: when all producers of a
stream have finished, its consumers finish too. Devices are cores on CPU: a controller
with devices pins its process to them, controllers sharing a device take turns one call
at a time (and hold no turn while they wait on a stream). On a Ray cluster with GPUs,
``devices=GPUs()`` gives each process a GPU from a placement group (`gpu_placement`). The first failure anywhere ends
the launch with a `FlowError` naming the role and instance, and kills every process.
"""
from mcore_rl.flow.entries import Many
from mcore_rl.flow.graph import (Controller, ControllerGroup, DataStream, Factory, GPUs,
                                 Replaceable, factory)
from mcore_rl.flow.launch import FlowError, RunningGraph, launch, start
from mcore_rl.flow.megatron import Megatron, rank_context
from mcore_rl.flow.services import Remote, finish_launch, lookup, publish
from mcore_rl.flow.stats import ControllerStats, FlowStats
from mcore_rl.flow.strategies import STRATEGIES

__all__ = ["DataStream", "Controller", "ControllerGroup", "Factory", "factory", "launch", "Many",
           "GPUs", "Replaceable", "start", "RunningGraph",
           "FlowError", "FlowStats", "ControllerStats", "STRATEGIES", "Megatron", "rank_context",
           "publish", "lookup", "finish_launch", "Remote"]
