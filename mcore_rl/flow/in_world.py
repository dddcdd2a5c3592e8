"""A graph whose controllers all run in one worker group (the others fused into it: the
``fused`` placement) run on the ranks of a torch.distributed world this process is already
part of, without Ray: the same item loop and fused stages a launch runs on the ranks of its
worker group, for a world started otherwise (a test's shared world, a benchmark's).

    stats = run_in_world(group)   # on every rank of the world; rank 0's stats, None elsewhere
"""
from __future__ import annotations

from mcore_rl.errors import UsageError
from mcore_rl.flow import services
from mcore_rl.flow.graph import ControllerGroup
from mcore_rl.flow.plan import OWN, build_plan
from mcore_rl.flow.stats import ControllerStats
from mcore_rl.flow.worker_group import RankRuntime


def run_in_world(group: ControllerGroup, num_epochs: int | None = 1) -> list[ControllerStats] | None:
    """Run ``group`` (one instance reading its own data, the rest fused into it, no streams
    to other processes) on this world's ranks; rank 0's stats, None on the other ranks."""
    import torch.distributed as dist

    plan = build_plan(group, False, None)
    if len(plan.instances) != 1 or plan.instances[0].input != OWN or plan.streams:
        raise UsageError("run_in_world runs one worker group that reads its own data, with "
                         "every other controller fused into it; launch the graph on Ray instead")
    spec = plan.instances[0]
    if spec.num_workers != dist.get_world_size():
        raise UsageError(f"controller {spec.name} has {spec.num_workers} workers, the world "
                         f"{dist.get_world_size()}")
    setup_of = getattr(spec.strategy, "rank_setup", None)
    runtime = RankRuntime(dist.get_rank())
    runtime.build(spec.function, setup_of() if callable(setup_of) else None,
                  dist.get_world_size(), spec.fused)
    try:
        return runtime.run_loop(spec, None, num_epochs, tell_failure=True)
    finally:
        runtime.close()
        services.unpublish_all()
