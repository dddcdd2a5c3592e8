"""A `device_plan` placed on a Ray cluster: a placement group per worker group and node, a
bundle per GPU, pinned to its node by Ray's node id (``ray.io/node-id``; nodes may share an
IP, several on one host), and the actor options that put a process into its bundle.

    nodes = cluster_nodes()
    slots = plan_devices(demands, nodes)          # refuses a cluster too small, before Ray does
    with Reservation.make(slots) as reserved:
        actor.options(**reserved.options(slot)).remote(...)

A process whose GPU is shared (colocated roles) takes an equal fraction of it, so Ray admits
every sharer into the same bundle; each process then binds the GPU Ray gave it
(`bind_gpu`) before torch.distributed starts."""
from __future__ import annotations

import contextlib
import os
from collections import Counter, defaultdict
from typing import Any

from mcore_rl.errors import UsageError
from mcore_rl.flow import ray_shim
from mcore_rl.flow.device_plan import GroupDemand, Node, Slot

READY_TIMEOUT_S = 60.0
"""How long the placement groups may take to be granted (the plan fits the cluster's GPUs;
past this, other jobs hold them)."""
NODE_LABEL = "ray.io/node-id"


def cluster_nodes() -> list[Node]:
    """The alive nodes that have GPUs, this process's node first."""
    ray = ray_shim.require()
    here = ray_shim.node_id()
    nodes = [Node(n["NodeID"], int(n.get("Resources", {}).get("GPU", 0)))
             for n in ray.nodes() if n.get("Alive")]
    nodes = [n for n in nodes if n.gpus]
    return sorted(nodes, key=lambda n: (n.id != here, n.id))


def has_gpus() -> bool:
    """Whether the connected Ray cluster has GPUs (logical ones included)."""
    return bool(ray_shim.require().cluster_resources().get("GPU", 0))


class Reservation:
    """The placement groups of one plan (one per worker group and node: an engine's group
    holds its workers' bundles only, as vLLM's Ray executor expects), and which bundle each
    slot lives in; colocated slots live in the bundles of the group they share."""

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self.groups: dict[tuple, Any] = {}
        """(role, replica, node) -> its placement group."""
        self.bundle: dict[tuple[str, int], tuple[tuple, int]] = {}
        """(node, gpu) -> (the key of the group holding it, the bundle's index there)."""
        self.sharers = Counter((s.node, s.gpu) for s in slots)

    @classmethod
    def make(cls, slots: list[Slot], timeout_s: float = READY_TIMEOUT_S) -> "Reservation":
        """The placement groups of ``slots``, once Ray has granted all of them; `UsageError`
        when it does not within ``timeout_s``."""
        from ray.util.placement_group import placement_group

        ray = ray_shim.require()
        self = cls(slots)
        owned: dict[tuple, list[int]] = defaultdict(list)
        for s in slots:
            if not s.shared:
                owned[(s.role, s.replica, s.node)].append(s.gpu)
        for key, gpus in owned.items():
            for index, gpu in enumerate(gpus):
                self.bundle[(key[2], gpu)] = (key, index)
            self.groups[key] = placement_group(
                [{"GPU": 1.0}] * len(gpus), strategy="STRICT_PACK",
                bundle_label_selector=[{NODE_LABEL: key[2]}] * len(gpus))
        try:
            ready = [pg.ready() for pg in self.groups.values()]
            done, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        except BaseException:  # interrupted while waiting: no group outlives the launch
            self.release()
            raise
        if pending:
            self.release()
            raise UsageError(f"Ray did not grant {len(pending)} of {len(ready)} placement group(s) "
                             f"within {timeout_s:.0f} s: other jobs hold their GPUs; wait or free them")
        return self

    def group_of(self, slot: Slot) -> Any:
        """The placement group ``slot``'s bundle belongs to."""
        return self.groups[self.bundle[(slot.node, slot.gpu)][0]]

    def options(self, slot: Slot, capture_child_tasks: bool = False) -> dict:
        """Actor options that put a process into ``slot``'s bundle with its share of the GPU."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        key, index = self.bundle[(slot.node, slot.gpu)]
        share = 1.0 / self.sharers[(slot.node, slot.gpu)]
        return {"num_cpus": 0, "num_gpus": share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.groups[key], placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=capture_child_tasks)}

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - Ray already gone
                pass
        self.groups = {}

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def bind_gpu(set_device: bool = True) -> int | None:
    """In a process Ray gave a GPU: the index of that GPU among the devices this process sees
    (``CUDA_VISIBLE_DEVICES``, which Ray sets), made torch's current device with
    ``set_device``; None without a GPU. Call it before torch.distributed starts (NCCL binds
    the current device)."""
    ids = [str(i) for i in ray_shim.require().get_gpu_ids()]
    if not ids:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible.index(ids[0]) if ids[0] in visible else 0
    if set_device:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(index)
    return index


def see_bundles(options: list[dict], timeout_s: float = 60.0) -> list[str]:
    """Make the GPUs of further bundles (``options``: a process's placement in each)
    visible to this process and what it starts: ``CUDA_VISIBLE_DEVICES`` becomes this
    process's GPU, then theirs in order. An actor takes resources from one bundle only, so
    an engine at TP N placed over N one-GPU bundles sits in the first, and its N workers
    (processes it starts, not Ray's) see the N GPUs this way; a light probe in each other
    bundle reads the GPU Ray gives there. Call it before CUDA starts in this process."""
    reports = _probe_reports(options, timeout_s)
    ids = [str(i) for i in ray_shim.require().get_gpu_ids()] + \
        [r["gpu_ids"][0] for r in reports if r["gpu_ids"]]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(ids))
    return ids


def _probe_reports(options: list[dict], timeout_s: float) -> list[dict]:
    """What a `DeviceProbe` started with each of ``options`` was given, the probes ended."""
    ray = ray_shim.require()
    cls = ray_shim.actor_class(DeviceProbe)
    actors = [cls.options(**opts).remote() for opts in options]
    try:
        return ray.get([a.report.remote() for a in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise UsageError(f"probes in the GPU bundles did not start within {timeout_s:.0f} s (the "
                         "cluster is busy or its nodes cannot start workers); try again") from None
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


class DeviceProbe:
    """A light actor placed like a rank (no torch): what it was given."""

    def report(self) -> dict:
        ray = ray_shim.require()
        return {"node": ray_shim.node_id(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "bound": bind_gpu(set_device=False)}


def probe(slots: list[Slot], reservation: Reservation, timeout_s: float = 60.0) -> list[dict]:
    """Start a `DeviceProbe` in every slot (as a rank is started there) and return what each
    was given, with the slot's plan: role, replica, rank, node, gpu (Ray's id), tp, pp, dp."""
    reports = _probe_reports([reservation.options(s) for s in slots], timeout_s)
    out = []
    for slot, report in zip(slots, reports):
        row = slot.as_dict()
        row.update(node=report["node"], gpu=int(report["gpu_ids"][0]) if report["gpu_ids"] else None,
                   cuda_visible_devices=report["cuda_visible_devices"], device_index=report["bound"],
                   shared=slot.shared)
        out.append(row)
    return out



def runs_ranks(spec) -> bool:
    """Whether an instance runs as a worker group (rank processes of its own, each taking a
    bundle), a group of one rank included; else its controller's process takes the GPUs."""
    return spec.num_workers > 1 or spec.strategy == "worker_group" \
        or bool(getattr(spec.strategy, "runs_ranks", False))


def demands_of(instances: list) -> list[GroupDemand]:
    """The GPU demand of every instance whose devices are `GPUs`: a worker group's ranks in
    its strategy's layout (``tp``, ``pp``; the rest data-parallel), or a process's
    ``per_process`` GPUs as one TP group (an engine's workers)."""
    from mcore_rl.flow.graph import GPUs

    out = []
    for spec in instances:
        gpus = spec.devices
        if not isinstance(gpus, GPUs):
            continue
        if runs_ranks(spec):
            tp, pp = getattr(spec.strategy, "tp", 1), getattr(spec.strategy, "pp", 1)
            out.append(GroupDemand(spec.role, spec.index, tp, pp, spec.num_workers // (tp * pp),
                                   share=gpus.share))
        else:
            out.append(GroupDemand(spec.role, spec.index, tp=gpus.per_process, share=gpus.share))
    return out


def slots_of(slots: list[Slot], role: str, replica: int) -> list[Slot]:
    """The slots of one worker group, in rank order."""
    return sorted((s for s in slots if s.role == role and s.replica == replica), key=lambda s: s.rank)


SIMULATED_NODE_CPUS = 1
"""CPUs of each simulated node (probes reserve none)."""


@contextlib.contextmanager
def simulated_cluster(nodes: int, gpus_per_node: int):
    """A local Ray of ``nodes`` nodes with ``gpus_per_node`` logical GPUs each, connected for
    the span of the block."""
    ray = ray_shim.require()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": SIMULATED_NODE_CPUS, "num_gpus": gpus_per_node, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=SIMULATED_NODE_CPUS, num_gpus=gpus_per_node)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
