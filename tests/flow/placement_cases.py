"""The placement cases of tests/flow/test_gpu_placement.py, run in one process with one
simulated cluster (``python -m tests.flow.placement_cases OUT``): every case's rows as
`mcore-rl placement` makes them, or its one-line refusal."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODES, GPUS = 2, 6
BASE = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "model.num_layers=4",
        "rollout.engine_tp=2"]
CASES = {
    "separate_two_engines": BASE + ["rollout.placement=separate", "rollout.replicas=2"],
    "colocated_two_engines": BASE + ["rollout.placement=colocated", "rollout.replicas=2"],
    "separate_one_engine": BASE + ["rollout.placement=separate"],
    "too_small": BASE + ["rollout.placement=separate", "rollout.replicas=3"],
}


class Report:
    """What a launched process was given: Ray's GPU ids and what it (and any worker it
    starts) sees in ``CUDA_VISIBLE_DEVICES``."""

    def report(self) -> dict:
        import os

        from mcore_rl.flow import ray_shim

        return {"node": ray_shim.node_id(),
                "gpu_ids": [str(i) for i in ray_shim.require().get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def launched() -> dict:
    """A graph started as a launch starts it: an engine-like process of two GPUs and a
    worker group of one rank, each asked what it was given."""
    from mcore_rl.flow import GPUs, Controller, ControllerGroup, factory, start

    graph = start(ControllerGroup([
        Controller("engine", factory(Report), devices=GPUs(2)),
        Controller("trainer", factory(Report), strategy="worker_group", num_workers=1,
                   devices=GPUs())]))
    try:
        return {role: graph.call(role, "report") for role in ("engine", "trainer")}
    finally:
        graph.close()


def main(out: str) -> None:
    from mcore_rl.cli.placement import probe_config
    from mcore_rl.flow.gpu_placement import simulated_cluster
    from mcore_rl.config import load_config
    from mcore_rl.errors import UsageError

    results = {}
    with simulated_cluster(NODES, GPUS):
        for name, overrides in CASES.items():
            cfg = load_config(REPO / "configs" / "quickstart.yaml", overrides)
            try:
                results[name] = {"rows": probe_config(cfg)[0]}
            except UsageError as err:
                results[name] = {"error": str(err)}
        results["launched"] = launched()
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
