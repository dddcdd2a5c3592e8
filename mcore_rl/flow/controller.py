"""One controller instance at run time: a Ray actor that builds its function through its
strategy and runs the instance's item loop (`mcore_rl.flow.item_loop`) where the function
runs: in this process for ``process``, on the first rank for a worker group.

The actor is threaded so that `kill_group`, and calls on the objects it published
(`mcore_rl.flow.services`), can run while `run` blocks. Its process leads its own process
group, so killing the group also kills whatever the function started."""
from __future__ import annotations

import os
import signal
from typing import Any

from mcore_rl.flow import ray_shim, services
from mcore_rl.flow.item_loop import ItemLoop
from mcore_rl.flow.plan import InstanceSpec
from mcore_rl.flow.processes import kill_process_group, lead_process_group
from mcore_rl.flow.stats import ControllerStats
from mcore_rl.flow.strategies import Executor, resolve_strategy


class ControllerProcess:
    """The actor behind one controller instance."""

    def __init__(self, spec: InstanceSpec, hub: Any = None, placements: list[dict] | None = None,
                 more_gpus: list[dict] | None = None):
        self.spec = spec
        self.placements = placements
        """Ray options of each of its processes (a GPU bundle each), or None (CPU)."""
        self.executor: Executor | None = None
        lead_process_group()
        services.set_hub(hub)
        if ray_shim.require().get_gpu_ids():  # placed in a GPU bundle: bind what Ray gave
            from mcore_rl.flow.gpu_placement import bind_gpu, see_bundles

            if more_gpus:  # its other bundles' GPUs too, for the workers it starts (vLLM's)
                see_bundles(more_gpus)
            bind_gpu()

    def where(self) -> tuple[str, int]:
        """(node id, pid) of this process."""
        return ray_shim.node_id(), os.getpid()

    def setup(self) -> list[tuple[str, int]]:
        """Build the function through the strategy; the processes the strategy started."""
        strategy = resolve_strategy(self.spec.strategy)
        self.executor = strategy(self.spec, placements=self.placements) \
            if self.placements is not None else strategy(self.spec)
        return self.executor.processes()

    def run(self, hub: Any, num_epochs: int | None = 1) -> list[ControllerStats]:
        """Move items until the input ends (or the launch is cancelled); the stats of this
        instance (and of the controllers fused into it)."""
        run_loop = getattr(self.executor, "run_loop", None)
        if run_loop is not None:
            return run_loop(self.spec, hub, num_epochs)
        stream = getattr(self.executor, "stream", None)  # a strategy of a user's, without one
        return ItemLoop(self.spec, hub, self.executor, stream=stream).run(num_epochs)

    def invoke(self, method: str, args: tuple, kwargs: dict, role: str | None = None) -> Any:
        """``method(*args, **kwargs)`` of the function's object (or of the fused controller
        ``role``'s), wherever it runs: how a driver calls a graph it started (`flow.start`)."""
        return self.executor.invoke(method, *args, role=role, **kwargs)

    def close(self) -> None:
        """Close the function (and its strategy's processes). The launch calls it once every
        instance has finished, so what one published stays usable to the last consumer."""
        if self.executor is not None:
            self.executor.close()

    def serve(self, name: str, attr: str, args: tuple | None, kwargs: dict | None) -> Any:
        """A call on an object this process published (`mcore_rl.flow.publish`)."""
        return services.serve(name, attr, args, kwargs)

    def kill_group(self) -> None:
        """Kill this process, what it started and the strategy's processes on this node."""
        here = ray_shim.node_id()
        for node, pid in self.executor.processes() if self.executor else []:
            if node == here:
                kill_process_group(pid)
        os.killpg(os.getpid(), signal.SIGKILL)
