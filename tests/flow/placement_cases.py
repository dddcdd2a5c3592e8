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
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
