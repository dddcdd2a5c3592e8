"""How a controller's function runs: the registry `STRATEGIES`.

A strategy is a callable ``spec -> Executor``, called once in the controller's process
(`InstanceSpec`: function, num_workers, devices). The executor is then called once per
item and returns the function's result. ``process`` runs the function in the controller's
own process; ``worker_group`` runs it SPMD on ``num_workers`` processes that form one
torch.distributed world and returns rank 0's result. A Megatron strategy (ranks that
build a model with `mcore_rl.parallel` and train it) registers here the same way."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from mcore_rl.errors import UsageError
from mcore_rl.flow.graph import build_function
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
    """The function, called in this process."""

    def __init__(self, function: Callable[[Any], Any]):
        self.function = function

    def __call__(self, item: Any) -> Any:
        return self.function(item)

    def processes(self) -> list[tuple[str, int]]:
        return []

    def stream(self, items):
        """A streaming function: called once with the input iterator; its outputs."""
        return self.function(items)

    def close(self) -> None:
        close = getattr(self.function, "close", None)
        if callable(close):
            close()


@STRATEGIES.register("process")
def run_in_process(spec: InstanceSpec) -> Executor:
    """One process: the controller's own, pinned to its devices."""
    if spec.num_workers != 1:
        raise UsageError(f"controller {spec.name}: strategy 'process' runs one process, "
                         f"num_workers={spec.num_workers} needs strategy 'worker_group'")
    pin_to_cores(spec.devices)
    return InProcess(build_function(spec.function))


@STRATEGIES.register("worker_group")
def run_as_worker_group(spec: InstanceSpec) -> Executor:
    """``num_workers`` processes in one torch.distributed world; rank 0's result."""
    from mcore_rl.flow.worker_group import WorkerGroup

    return WorkerGroup.start(spec)
