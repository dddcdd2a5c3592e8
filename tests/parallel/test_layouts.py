"""Megatron process groups for TP/PP/DP/VPP layouts, built inside one shared gloo world."""
import pytest

from tests.world import shared_world


@pytest.fixture(scope="module")
def world():
    return shared_world(4)


def _groups(rank, world_size, tp, pp, vpp):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    ctx = initialize_parallel(tp=tp, pp=pp, vpp=vpp)
    out = dict(layout=str(ctx.layout), tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, dp_rank=ctx.dp_rank,
               tp=ctx.group_ranks(ctx.tp_group), pp=ctx.group_ranks(ctx.pp_group),
               dp=ctx.group_ranks(ctx.dp_group), first=ctx.is_first_stage, last=ctx.is_last_stage)
    destroy_parallel()
    return out


def test_tp2_pp2_groups_have_the_expected_members(world):
    res = world.run(_groups, 2, 2, None)
    # Megatron's order is tp fastest, then dp, then pp: TP groups {0,1},{2,3}; PP {0,2},{1,3}.
    assert [r["tp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["dp"] for r in res] == [[0], [1], [2], [3]]
    assert [(r["tp_rank"], r["pp_rank"]) for r in res] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(r["first"], r["last"]) for r in res] == [(True, False)] * 2 + [(False, True)] * 2
    assert {r["layout"] for r in res} == {"TP2xPP2xDP1"}


def test_dp_is_inferred_and_dp_groups_span_model_replicas(world):
    res = world.run(_groups, 2, 1, None)
    assert [r["dp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["dp_rank"] for r in res] == [0, 0, 1, 1]
    assert {r["layout"] for r in res} == {"TP2xPP1xDP2"}


def test_layouts_can_be_switched_inside_one_world(world):
    for tp, pp, vpp, name in [(1, 4, None, "TP1xPP4xDP1"), (1, 2, 2, "TP1xPP2xVPP2xDP2"),
                              (4, 1, None, "TP4xPP1xDP1")]:
        res = world.run(_groups, tp, pp, vpp)
        assert {r["layout"] for r in res} == {name}
        assert all(len(r["tp"]) == tp and len(r["pp"]) == pp for r in res)


def _bad_layout(rank, world_size):
    from mcore_rl.parallel import initialize_parallel

    initialize_parallel(tp=3)


def test_a_layout_that_does_not_fit_the_world_fails_on_every_rank(world):
    with pytest.raises(AssertionError, match="not divisible by tp\\*pp = 3\\*1"):
        world.run(_bad_layout)


def _gloo_threads() -> int:
    import os

    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def _build_and_train(rank, world_size, hf_dir, tp, pp):
    """A model of ``tp`` x ``pp`` built, trained one step and dropped (no garbage collection
    of its own); the process's gloo threads."""
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.data.batch import Batch
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.rl.warm_start import nll_loss
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(tp=tp, pp=pp)
    try:
        built = build_model(hf_dir, ctx)
        engine = build_engine(built.chunks, ctx, vocab_size=built.spec.arch.vocab_size,
                              optim=OptimizerConfig(lr=1e-3))
        engine.train_batch(Batch.from_sequences([[3, 4, 5, 6, 7], [8, 9, 10]], prompt_lens=[2, 1]),
                           nll_loss)
        del engine, built
    finally:
        destroy_parallel()
    return _gloo_threads()


def test_layouts_built_in_turn_leave_no_process_groups_behind(world, tmp_path_factory):
    """Megatron memoises its rotary embedding's forward (the module, and so its process
    groups, stay referenced), and a trained model holds its groups in reference cycles;
    teardown clears the one and collects the other, so a world that builds model after
    model keeps the same gloo threads (each live group has one that wakes up all the time)."""
    from tests.models.tiny_hf import save_tiny_hf_model

    hf_dir = str(save_tiny_hf_model("llama-untied", tmp_path_factory.mktemp("leak") / "hf"))
    counts = [world.run(_build_and_train, hf_dir, *layout)
              for layout in ((2, 2), (2, 1), (1, 2), (2, 2))]
    assert counts[-1] == counts[0], counts
