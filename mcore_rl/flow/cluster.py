"""The nodes of the Ray cluster: which node each rank of a worker group runs on, and waiting
for a cluster's nodes to join (the SLURM job script does, before it starts its driver).

    python -m mcore_rl.flow.cluster wait --nodes 2 --timeout 180   # RAY_ADDRESS names the head

On one node (the embedded local Ray) ranks go wherever Ray puts them, as they always did.
On several, the ranks fill the nodes evenly in contiguous blocks, the calling process's
node first: ranks 0..k-1 on the first node, k..2k-1 on the next (k = ceil(ranks / nodes)),
so that neighbouring ranks (a TP group) share a node and rank 0, whose node the rendezvous
address is on, runs beside its driver. On CPU ranks reserve no Ray CPUs (each pins itself),
so they are placed by node affinity; on GPUs by bundles of placement groups
(`mcore_rl.flow.gpu_placement`)."""
from __future__ import annotations

import argparse
import math
import time

from mcore_rl.flow import ray_shim


def alive_nodes() -> list[str]:
    """Ids of the nodes that can run ranks (alive, with CPUs or GPUs), this process's first."""
    ray = ray_shim.require()
    nodes = [n["NodeID"] for n in ray.nodes()
             if n.get("Alive") and (n.get("Resources", {}).get("CPU", 0)
                                    or n.get("Resources", {}).get("GPU", 0))]
    here = ray_shim.node_id()
    return sorted(nodes, key=lambda n: (n != here, n))


def rank_nodes(num_ranks: int, nodes: list[str] | None = None) -> list[str | None]:
    """The node of each rank (None: anywhere, on a single-node cluster)."""
    nodes = alive_nodes() if nodes is None else nodes
    if len(nodes) <= 1:
        return [None] * num_ranks
    per_node = math.ceil(num_ranks / len(nodes))
    return [nodes[rank // per_node] for rank in range(num_ranks)]


def wait_for_nodes(count: int, timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Block until the connected cluster has ``count`` nodes that can run ranks."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = alive_nodes()
        if len(nodes) >= count:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray cluster has {len(nodes)} of {count} nodes after "
                               f"{timeout_s:.0f}s")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.flow.cluster")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wait", help="wait until the cluster (RAY_ADDRESS) has N nodes")
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--timeout", type=float, default=180.0)
    args = p.parse_args(argv)
    ray = ray_shim.require()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        nodes = wait_for_nodes(args.nodes, args.timeout)
    except TimeoutError as err:
        print(f"mcore_rl.flow.cluster: {err}", flush=True)
        return 1
    finally:
        ray.shutdown()
    print(f"mcore_rl.flow.cluster: {len(nodes)} Ray nodes up", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
