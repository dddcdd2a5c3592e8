"""How a controller's function runs: the registry `STRATEGIES`.

A strategy is a callable ``spec -> Executor``, called once in the controller's process
(`InstanceSpec`: function, num_workers, devices, the controllers fused into it). The
executor runs the instance's item loop where the function runs (`run_loop`) and answers a
driver's calls on the function (`invoke`). ``process`` runs the function in the
controller's own process; ``worker_group`` runs it SPMD on ``num_workers`` processes that
form one torch.distributed world and returns rank 0's result. A Megatron strategy (ranks
that build a model with `mcore_rl.parallel` and train it) registers here the same way."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

from mcore_rl.errors import UsageError
from mcore_rl.flow.graph import build_function
from mcore_rl.flow.item_loop import ItemLoop, Stage, close_all
from mcore_rl.flow.placement import pin_to_cores
from mcore_rl.flow.plan import InstanceSpec
from mcore_rl.registry import Registry


class Executor(Protocol):
    """A controller's function, ready to be called per item."""

    def __call__(self, item: Any) -> Any: ...

    def processes(self) -> list[tuple[str, int]]:
        """(node id, pid) of the processes it started besides the controller's own, so the
        launch can kill them (and what they started) on teardown."""
        ...

    def close(self) -> None: ...


STRATEGIES: Registry[Callable[[InstanceSpec], Executor]] = Registry("controller strategy")


def resolve_strategy(strategy: Any) -> Callable[[InstanceSpec], Executor]:
    """A controller's ``strategy``: a registered name, or the strategy object itself."""
    return STRATEGIES.get(strategy) if isinstance(strategy, str) else strategy


class InProcess:
    """The function (and the controllers fused into it), called in this process."""

    def __init__(self, function: Callable[[Any], Any], stages: list[Stage] | None = None):
        self.function = function
        self.stages = stages or []

    def __call__(self, item: Any) -> Any:
        return self.function(item)

    def processes(self) -> list[tuple[str, int]]:
        return []

    def stream(self, items: Iterator) -> Iterator:
        """A streaming function: called once with the input iterator; its outputs."""
        return self.function(items)

    def run_loop(self, spec: InstanceSpec, hub: Any, num_epochs: int | None):
        return ItemLoop(spec, hub, self.function, stream=self.stream, stages=self.stages).run(num_epochs)

    def invoke(self, method: str, *args: Any, role: str | None = None, **kwargs: Any) -> Any:
        target = self.function if role is None else \
            next(s.function for s in self.stages if s.stats.role == role)
        return getattr(target, method)(*args, **kwargs)

    def close(self) -> None:
        close_all(self.stages, self.function)


@STRATEGIES.register("process")
def run_in_process(spec: InstanceSpec) -> Executor:
    """One process: the controller's own, pinned to its devices."""
    if spec.num_workers != 1:
        raise UsageError(f"controller {spec.name}: strategy 'process' runs one process, "
                         f"num_workers={spec.num_workers} needs strategy 'worker_group'")
    pin_to_cores(spec.devices if isinstance(spec.devices, tuple) else None)
    stages = [Stage(s.role, 0, build_function(s.function)) for s in spec.fused]
    return InProcess(build_function(spec.function), stages)


@STRATEGIES.register("worker_group")
def run_as_worker_group(spec: InstanceSpec, placements: list[dict] | None = None) -> Executor:
    """``num_workers`` processes in one torch.distributed world; rank 0's result."""
    from mcore_rl.flow.worker_group import WorkerGroup

    return WorkerGroup.start(spec, placements=placements)
