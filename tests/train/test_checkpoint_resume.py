"""Saving the full training state and resuming continues bit-identically."""
import pytest
import torch

from mcore_rl.models import ModelArch
from tests.world import shared_world

VOCAB = 200
ARCH = ModelArch(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2)


def batch_for_step(step: int):
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(4, 16, (6,), generator=g).tolist()
    return Batch.from_sequences([torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths],
                                prompt_lens=[2] * 6)


def loss_fn(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def _engine(ctx, seed_offset=0):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.train.build import build_engine

    torch.manual_seed(seed_offset)
    optim = OptimizerConfig(lr=1e-2, warmup_steps=2, decay_style="cosine", min_lr=1e-3,
                            weight_decay=0.01, micro_batch_tokens=40)
    return build_engine(build_gpt_chunks(ARCH, ctx), ctx, vocab_size=VOCAB, optim=optim, total_steps=6)


def _params(engine):
    return {n: p.detach().clone() for m in engine.model for n, p in m.named_parameters()}


def _run(rank, world_size, layout, ckpt, k):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine, save_engine

    tp, pp, cp = layout
    ctx = initialize_parallel(tp=tp, pp=pp, cp=cp, seed=5)
    engine = _engine(ctx)
    for step in range(k):
        engine.train_batch(batch_for_step(step), loss_fn)
    save_engine(engine, ckpt, extra={"data_position": k})
    for step in range(k, k + 2):
        engine.train_batch(batch_for_step(step), loss_fn)
    uninterrupted, lr_a = _params(engine), engine.optimizer.param_groups[0]["lr"]
    destroy_parallel()

    # A new process state: other seed, fresh model and optimizer, then resume.
    ctx = initialize_parallel(tp=tp, pp=pp, cp=cp, seed=99)
    engine = _engine(ctx, seed_offset=1)
    extra = load_engine(engine, ckpt)
    for step in range(extra["data_position"], extra["data_position"] + 2):
        engine.train_batch(batch_for_step(step), loss_fn)
    resumed, lr_b = _params(engine), engine.optimizer.param_groups[0]["lr"]
    destroy_parallel()
    unequal = [n for n in uninterrupted if not torch.equal(uninterrupted[n], resumed[n])]
    return unequal, lr_a, lr_b, engine.steps_done


@pytest.fixture(scope="module")
def world():
    return shared_world(2)


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["TP2", "PP2", "CP2"])
def test_resume_after_step_k_is_bit_identical_two_steps_later(world, tmp_path, layout):
    for unequal, lr_a, lr_b, steps in world.run(_run, layout, str(tmp_path / "ckpt"), 2):
        assert unequal == [], f"parameters differ after resuming: {unequal[:5]}"
        assert lr_a == lr_b and steps == 4


def _resume_skipping_optimizer_differs(rank, world_size, ckpt):
    """Control: loading only the weights (fresh Adam state) must not be bit-identical."""
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine, save_engine

    ctx = initialize_parallel(tp=2, seed=5)
    engine = _engine(ctx)
    for step in range(2):
        engine.train_batch(batch_for_step(step), loss_fn)
    save_engine(engine, ckpt)
    for step in range(2, 4):
        engine.train_batch(batch_for_step(step), loss_fn)
    a = _params(engine)
    destroy_parallel()
    ctx = initialize_parallel(tp=2, seed=5)
    engine = _engine(ctx)
    load_engine(engine, ckpt, load_optimizer=False)
    for step in range(2, 4):
        engine.train_batch(batch_for_step(step), loss_fn)
    b = _params(engine)
    destroy_parallel()
    return all(torch.equal(a[n], b[n]) for n in a)


def test_optimizer_state_matters_so_the_resume_test_can_fail(world, tmp_path):
    assert world.run(_resume_skipping_optimizer_differs, str(tmp_path / "ckpt")) == [False, False]


def _save_and_list_helpers(rank, world_size, ckpt):
    import psutil

    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import save_engine

    ctx = initialize_parallel(tp=2, pp=1, seed=5)
    save_engine(_engine(ctx), ckpt)
    destroy_parallel()
    return [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
            if "multiprocessing" in " ".join(p.cmdline())]


def test_a_save_leaves_no_helper_process_behind(world, tmp_path):
    """Megatron's writer would serve its results from a spawned manager process (seconds on a
    process's first save, and an orphan when a rank is killed); synchronous saves need none."""
    assert world.run(_save_and_list_helpers, str(tmp_path / "ckpt")) == [[], []]
