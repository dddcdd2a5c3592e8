"""`plan_devices`: which GPU of which node each rank and engine worker gets (no Ray)."""
from __future__ import annotations

from collections import Counter

import pytest

from mcore_rl.errors import UsageError
from mcore_rl.flow.device_plan import GroupDemand, Node, plan_devices


def nodes(n: int, gpus: int) -> list[Node]:
    return [Node(f"node{i}", gpus) for i in range(n)]


def groups_of(slots, role, key):
    out: dict = {}
    for s in slots:
        if s.role == role:
            out.setdefault(key(s), set()).add(s.node)
    return out


def test_tp_groups_and_model_replicas_stay_on_a_node_dp_spreads_engines_get_their_own_gpus():
    demands = [GroupDemand("trainer", tp=2, pp=2, dp=2),
               GroupDemand("rollout", 0, tp=2), GroupDemand("rollout", 1, tp=2)]
    slots = plan_devices(demands, nodes(2, 6))
    trainer = [s for s in slots if s.role == "trainer"]
    assert sorted(s.rank for s in trainer) == list(range(8))
    # Megatron's order: TP fastest, then DP, then PP
    assert {(s.rank, s.tp, s.dp, s.pp) for s in trainer} >= {(1, 1, 0, 0), (2, 0, 1, 0), (4, 0, 0, 1)}
    replicas = groups_of(slots, "trainer", lambda s: s.dp)
    assert all(len(n) == 1 for n in replicas.values())  # a model replica on one node
    assert replicas[0] != replicas[1]  # the two DP replicas on different nodes
    engines = groups_of(slots, "rollout", lambda s: s.replica)
    assert all(len(n) == 1 for n in engines.values()) and engines[0] != engines[1]
    used = Counter((s.node, s.gpu) for s in slots)
    assert max(used.values()) == 1 and len(used) == 12  # separate: no GPU shared


def test_stages_of_a_model_too_large_for_a_node_go_over_nodes_each_tp_group_on_one():
    slots = plan_devices([GroupDemand("trainer", tp=4, pp=2, dp=1)], nodes(2, 4))
    stages = groups_of(slots, "trainer", lambda s: s.pp)
    assert all(len(n) == 1 for n in stages.values()) and stages[0] != stages[1]


def test_colocated_engines_share_the_trainers_gpus_replica_by_replica():
    demands = [GroupDemand("trainer", tp=2, pp=1, dp=2),
               GroupDemand("rollout", 0, tp=2, share="trainer"),
               GroupDemand("rollout", 1, tp=2, share="trainer")]
    slots = plan_devices(demands, nodes(2, 2))
    trainer = {(s.node, s.gpu): s.rank for s in slots if s.role == "trainer"}
    for s in slots:
        if s.role == "rollout":
            assert s.shared and trainer[(s.node, s.gpu)] == s.replica * 2 + s.rank
    assert len({(s.node, s.gpu) for s in slots}) == 4


def test_a_cluster_too_small_is_refused_with_what_it_needs():
    demands = [GroupDemand("trainer", tp=2, pp=2, dp=2), GroupDemand("rollout", 0, tp=2)]
    with pytest.raises(UsageError, match=r"needs 10 GPUs \(trainer 8 \+ rollout 2\) but the "
                                         r"cluster has 8 \(2 node\(s\) x 4, 4\)"):
        plan_devices(demands, nodes(2, 4))


def test_a_tp_group_larger_than_any_nodes_free_gpus_is_refused():
    with pytest.raises(UsageError, match="a TP group of 8 GPUs must lie on one node"):
        plan_devices([GroupDemand("trainer", tp=8)], nodes(2, 4))


def test_more_colocated_replicas_than_the_trainer_has_gpus_are_refused():
    demands = [GroupDemand("trainer", tp=2), GroupDemand("rollout", 0, tp=2, share="trainer"),
               GroupDemand("rollout", 1, tp=2, share="trainer")]
    with pytest.raises(UsageError, match="colocated replica"):
        plan_devices(demands, nodes(1, 4))
