"""Which GPU of which node each process of a graph gets: a plan computed from the cluster's
nodes before anything is placed (pure Python; `mcore_rl.flow.gpu_placement` turns it into
Ray placement groups).

A `GroupDemand` is one worker group: a trainer's ``tp * pp * dp`` ranks in Megatron's rank
order (TP fastest, then DP, then PP), or an engine replica's ``tp`` workers. The plan:

- keeps every TP group on one node (its all-reduces need the node's links), and a model
  replica (a TP group and its PP neighbours) on one node where it fits, else its stages on
  as few nodes as possible;
- spreads data-parallel replicas over the nodes (round robin, the node with most free GPUs
  first), so that no node is filled while another idles;
- gives engines of ``separate`` placement GPUs of their own, and engines of ``colocated``
  placement the GPUs of the group they share (``share``): replica r takes that group's GPUs
  r*tp .. r*tp+tp-1, which must lie on one node.

A cluster too small for the demands is refused with one `UsageError` naming what is
missing, before any placement group exists (Ray would leave an infeasible group pending
forever)."""
from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.errors import UsageError


@dataclass(frozen=True)
class Node:
    """A node of the cluster: Ray's node id and its GPUs."""

    id: str
    gpus: int


@dataclass(frozen=True)
class GroupDemand:
    """The GPUs one worker group needs: one per rank, ``tp * pp * dp`` ranks."""

    role: str
    replica: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    share: str | None = None
    """Colocated: the role whose GPUs this group shares (its first replica); None: GPUs of
    its own."""

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, pp, dp) rank of ``rank`` in Megatron's order (TP fastest, then DP, then PP)."""
        return rank % self.tp, rank // (self.tp * self.dp), (rank // self.tp) % self.dp


@dataclass(frozen=True)
class Slot:
    """One process's GPU: ``gpu`` is its index among the node's GPUs in the plan (Ray picks
    the physical device of the bundle; the process binds what Ray gives it)."""

    role: str
    replica: int
    rank: int
    node: str
    gpu: int
    tp: int
    pp: int
    dp: int
    shared: bool = False
    """The GPU is shared with another group (colocated)."""

    def as_dict(self) -> dict:
        return {"role": self.role, "replica": self.replica, "rank": self.rank, "node": self.node,
                "gpu": self.gpu, "tp": self.tp, "pp": self.pp, "dp": self.dp}


def plan_devices(demands: list[GroupDemand], nodes: list[Node]) -> list[Slot]:
    """A `Slot` per rank of every demand; `UsageError` when the nodes cannot hold them."""
    if not nodes or not any(n.gpus for n in nodes):
        raise UsageError("the Ray cluster has no GPUs; on CPU the ranks pin cores instead "
                         "(start Ray on GPU nodes, or run without GPU placement)")
    demands = sorted(demands, key=lambda d: -d.ranks)  # the largest groups first: they pack
    needed = sum(d.ranks for d in demands if d.share is None)
    have = sum(n.gpus for n in nodes)
    if needed > have:
        parts = " + ".join(f"{d.role}{'' if d.replica == 0 and _single(demands, d) else f' #{d.replica}'}"
                           f" {d.ranks}" for d in demands if d.share is None)
        raise UsageError(f"the config needs {needed} GPUs ({parts}) but the cluster has {have} "
                         f"({len(nodes)} node(s) x {', '.join(str(n.gpus) for n in nodes)}); "
                         "add nodes or shrink the layout")
    free = {n.id: list(range(n.gpus)) for n in nodes}
    order = [n.id for n in nodes]
    slots: list[Slot] = []
    for demand in demands:
        if demand.share is None:
            slots += _place_own(demand, free, order)
    for demand in demands:
        if demand.share is not None:
            slots += _place_shared(demand, slots)
    return slots


def _single(demands: list[GroupDemand], d: GroupDemand) -> bool:
    return sum(x.role == d.role for x in demands) == 1


def _place_own(demand: GroupDemand, free: dict[str, list[int]], order: list[str]) -> list[Slot]:
    """GPUs of its own for every rank of ``demand``, taken from ``free``."""
    model = demand.tp * demand.pp
    slots: list[Slot] = []
    for dp in range(demand.dp):
        units = [[_rank(demand, t, pp, dp) for t in range(demand.tp)] for pp in range(demand.pp)]
        node = _node_with(free, order, model)
        if node is not None:  # the whole model replica on one node
            for unit in units:
                slots += _take(demand, unit, node, free)
            continue
        for unit in units:  # its stages over several nodes, each TP group on one
            node = _node_with(free, order, demand.tp)
            if node is None:
                left = ", ".join(str(len(free[n])) for n in order)
                raise UsageError(f"{demand.role}: a TP group of {demand.tp} GPUs must lie on one "
                                 f"node, and no node has {demand.tp} free (free per node: {left}); "
                                 "lower its tensor parallelism, or use larger nodes")
            slots += _take(demand, unit, node, free)
    return slots


def _rank(d: GroupDemand, tp: int, pp: int, dp: int) -> int:
    return tp + d.tp * (dp + d.dp * pp)


def _node_with(free: dict[str, list[int]], order: list[str], count: int) -> str | None:
    """The node with most free GPUs that has ``count`` free (ties: cluster order)."""
    fits = [n for n in order if len(free[n]) >= count]
    return max(fits, key=lambda n: (len(free[n]), -order.index(n))) if fits else None


def _take(demand: GroupDemand, ranks: list[int], node: str, free: dict[str, list[int]]) -> list[Slot]:
    gpus, free[node] = free[node][:len(ranks)], free[node][len(ranks):]
    out = []
    for rank, gpu in zip(ranks, gpus):
        tp, pp, dp = demand.coords(rank)
        out.append(Slot(demand.role, demand.replica, rank, node, gpu, tp, pp, dp))
    return out


def _place_shared(demand: GroupDemand, placed: list[Slot]) -> list[Slot]:
    """GPUs of the group ``demand.share`` (its first replica), ``tp`` per replica."""
    host = sorted((s for s in placed if s.role == demand.share and s.replica == 0),
                  key=lambda s: s.rank)
    if not host:
        raise UsageError(f"{demand.role} shares the GPUs of '{demand.share}', which has none")
    start = demand.replica * demand.ranks
    mine = host[start:start + demand.ranks]
    if len(mine) < demand.ranks:
        raise UsageError(f"{demand.role}: {demand.replica + 1} colocated replica(s) of "
                         f"{demand.ranks} GPU(s) need {start + demand.ranks} of '{demand.share}''s "
                         f"{len(host)} GPUs; lower rollout.replicas or rollout.engine_tp, or use "
                         "rollout.placement=separate")
    if len({s.node for s in mine}) > 1:
        raise UsageError(f"{demand.role} replica {demand.replica}: its TP group of {demand.tp} "
                         f"would span nodes in '{demand.share}''s GPUs; choose rollout.engine_tp "
                         "dividing the trainer's GPUs per node")
    return [Slot(demand.role, demand.replica, rank, s.node, s.gpu, *demand.coords(rank), shared=True)
            for rank, s in enumerate(mine)]


def describe(slots: list[Slot], nodes: list[Node]) -> str:
    """The plan as a table: one line per node, each GPU with the processes on it."""
    lines = []
    for i, node in enumerate(nodes):
        used = {}
        for s in slots:
            if s.node == node.id:
                used.setdefault(s.gpu, []).append(
                    f"{s.role}{'' if s.replica == 0 else f'#{s.replica}'}.r{s.rank}"
                    f"(tp{s.tp} pp{s.pp} dp{s.dp})")
        cells = [f"gpu{g}: {' + '.join(used.get(g, ['-']))}" for g in range(node.gpus)]
        lines.append(f"node {i} ({node.id[:12]}): " + "; ".join(cells))
    return "\n".join(lines)
