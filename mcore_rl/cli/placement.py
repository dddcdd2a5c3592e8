"""`mcore-rl placement CONFIG [overrides] --nodes N --gpus-per-node G [--json OUT]`: where
every rank and engine worker of the config's graph would run on a cluster of N nodes with G
GPUs each, as a dry run on this machine.

It starts a local Ray of N simulated nodes with G logical GPUs each, plans the graph's GPUs
and creates its placement groups with the same code a launch uses (`mcore_rl.flow.
gpu_placement`), starts a light probe actor (no torch) in every slot with the options a
rank or an engine's worker there gets, and prints what each was given: its node, its GPU (``ray.get_gpu_ids()``),
``CUDA_VISIBLE_DEVICES`` and the device index the rank would bind. Nothing of the job runs
and nothing is written but ``--json``. A cluster too small for the config is refused in one
line before any placement group exists."""
from __future__ import annotations

import json
from pathlib import Path

from mcore_rl.config import load_config
from mcore_rl.errors import UsageError

def probe_config(cfg) -> tuple[list[dict], str]:
    """(one row per slot, a table by node) for ``cfg``'s graph on the connected cluster:
    planned and placed by the code a launch uses, each slot probed."""
    from mcore_rl.flow import gpu_placement
    from mcore_rl.flow.device_plan import describe, plan_devices
    from mcore_rl.flow.plan import build_plan
    from mcore_rl.roles.graph import job_graph

    _, job = job_graph(cfg, gpus=True, dry_run=True)
    plan = build_plan(job.group, job.data is not None, None, max_in_flight=job.max_in_flight)
    found = gpu_placement.cluster_nodes()
    slots = plan_devices(gpu_placement.demands_of(plan.instances), found)  # before any group
    with gpu_placement.Reservation.make(slots) as reservation:
        rows = gpu_placement.probe(slots, reservation)
    index = {n.id: i for i, n in enumerate(found)}
    for row in rows:
        row["node_id"], row["node"] = row["node"], index[row["node"]]
    return rows, describe(slots, found)


def run(args) -> int:
    from mcore_rl.roles.rules import check_config, world_size_of

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UsageError(f"--nodes and --gpus-per-node must be >= 1, got {args.nodes} and "
                         f"{args.gpus_per_node}")
    cfg = load_config(args.config, args.overrides)
    check_config(cfg, world_size_of(cfg))
    from mcore_rl.flow.gpu_placement import simulated_cluster

    with simulated_cluster(args.nodes, args.gpus_per_node):
        rows, table = probe_config(cfg)
    print(table)
    for row in rows:
        print(f"{row['role']:<8} replica {row['replica']} rank {row['rank']:>3}  node {row['node']} "
              f"gpu {row['gpu']}  tp{row['tp']} pp{row['pp']} dp{row['dp']}  "
              f"CUDA_VISIBLE_DEVICES={row['cuda_visible_devices']}  binds cuda:{row['device_index']}"
              + ("  (shared)" if row["shared"] else ""))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("placement", help="print where a config's ranks and engines run "
                                                "on a GPU cluster (dry run)")
    p.add_argument("config", help="YAML config")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the cluster")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs of each node")
    p.add_argument("--json", default=None, help="write the map as JSON here")
    p.set_defaults(func=run)
