"""Where worker-group ranks go: over several Ray nodes they fill the nodes evenly, in
contiguous blocks from the caller's node; on one node they go wherever Ray puts them. The
real several-node case runs in tests/launch/test_slurm_jobs.py (two SLURM nodes)."""
from mcore_rl.flow.cluster import alive_nodes, rank_nodes


def test_ranks_fill_several_nodes_evenly_in_contiguous_blocks_from_the_first():
    assert rank_nodes(2, ["a", "b"]) == ["a", "b"]
    assert rank_nodes(4, ["a", "b"]) == ["a", "a", "b", "b"]  # a TP2 group per node
    assert rank_nodes(3, ["a", "b"]) == ["a", "a", "b"]
    assert rank_nodes(2, ["a", "b", "c"]) == ["a", "b"]
    assert rank_nodes(8, ["a", "b", "c", "d"]) == ["a", "a", "b", "b", "c", "c", "d", "d"]


def test_on_one_node_ranks_are_not_pinned_to_it(ray_cluster):
    here = ray_cluster.get_runtime_context().get_node_id()
    assert alive_nodes() == [here]
    assert rank_nodes(3) == [None, None, None]
    assert rank_nodes(2, ["a"]) == [None, None]
