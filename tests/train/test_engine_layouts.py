"""One `train_batch` gives the same updated parameters at every layout.

The oracle is the single-rank run (TP1 PP1 DP1, in a world of one). All layouts start from
the same weights (a distributed checkpoint written by the oracle), train on one fixed batch
of variable-length sequences split into several micro-batches with unequal token counts,
and save their result; the saved models are compared tensor by tensor at TP1.

SGD without clipping makes the update proportional to the gradient, so a wrongly scaled
gradient (loss averaged per micro-batch or per DP rank, a missing reduction of tied
embeddings) changes the result; Adam's normalisation would hide a uniform scale.
"""
import os

import pytest
import torch
import torch.distributed as dist

from mcore_rl.models import ModelArch
from tests.world import shared_world

VOCAB = 250
LAYOUTS = {"TP2": (2, 1, None), "PP2": (1, 2, None), "DP2": (1, 1, None), "PP2xVPP2": (1, 2, 2)}


def arch(tied: bool) -> ModelArch:
    return ModelArch(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_attention_heads=4, num_kv_heads=2, tie_word_embeddings=tied)


def fixed_batch():
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(7)
    lengths = [5, 17, 9, 12, 3, 20, 8, 14]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return Batch.from_sequences(seqs, prompt_lens=[2, 4, 3, 1, 1, 6, 2, 5])


def token_mean_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {"tokens": mask.sum()}


def seq_mean_loss(outputs, mb):
    mask = mb["response_mask"].float()
    per_seq = -(outputs["logprobs"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    real = (mask.sum(-1) > 0).float()  # uniform-shape filler rows are not sequences
    return (per_seq * real).sum(), real.sum(), {}


LOSSES = {"token_mean": token_mean_loss, "seq_mean": seq_mean_loss}


def _engine(ctx, tied):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.train.build import build_engine

    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=48)
    return build_engine(build_gpt_chunks(arch(tied), ctx), ctx, vocab_size=VOCAB, optim=optim)


def _train_once(rank, world_size, layout, tied, loss, init_dir, out_dir):
    """Build at ``layout``, load ``init_dir`` (or write it, for the oracle), train one
    batch, save the model to ``out_dir``."""
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine, save_engine

    tp, pp, vpp = layout
    ctx = initialize_parallel(tp=tp, pp=pp, vpp=vpp, seed=11)
    engine = _engine(ctx, tied)
    if os.path.exists(init_dir):
        load_engine(engine, init_dir, load_optimizer=False)
    else:
        save_engine(engine, init_dir)
    result = engine.train_batch(fixed_batch(), LOSSES[loss])
    save_engine(engine, out_dir)
    n_micro = len(engine._plan(fixed_batch()))
    destroy_parallel()
    return result.loss, result.units, n_micro


def _model_tensors(rank, world_size, tied, path):
    """All model tensors of a saved checkpoint, loaded at TP1 PP1."""
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine

    ctx = initialize_parallel(seed=3)
    engine = _engine(ctx, tied)
    load_engine(engine, path, load_optimizer=False)
    state = {k: v.detach().clone() for k, v in engine.model[0].module.state_dict().items()
             if torch.is_tensor(v) and "_extra_state" not in k}
    destroy_parallel()
    return state


@pytest.fixture(scope="module")
def oracle_world():
    return shared_world(1)


@pytest.fixture(scope="module")
def world():
    return shared_world(2)


def max_relative_difference(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    worst, where = 0.0, ""
    for k in a:
        d = ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item()
        if d > worst:
            worst, where = d, k
    return worst, where


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_one_train_batch_updates_parameters_identically_at_every_layout(
        oracle_world, world, tmp_path, tied, loss):
    init = str(tmp_path / "init")
    (ref_loss, ref_units, ref_micro), = oracle_world.run(
        _train_once, (1, 1, None), tied, loss, init, str(tmp_path / "oracle"))
    assert ref_micro >= 3, "the batch must span several micro-batches"
    before = oracle_world.run(_model_tensors, tied, init)[0]
    expected = oracle_world.run(_model_tensors, tied, str(tmp_path / "oracle"))[0]
    moved, _ = max_relative_difference(expected, before)
    assert moved > 1e-3, "the step must change the parameters visibly"
    for name, layout in LAYOUTS.items():
        out = str(tmp_path / name)
        results = world.run(_train_once, layout, tied, loss, init, out)
        for step_loss, units, _ in results:
            assert units == ref_units
            assert step_loss == pytest.approx(ref_loss, rel=1e-5)
        got = oracle_world.run(_model_tensors, tied, out)[0]
        diff, where = max_relative_difference(got, expected)
        assert diff <= 1e-5, f"{name}: parameters differ from TP1 by {diff:.2e} (worst: {where})"


def max_and_sum_loss(outputs, mb):
    """A token-mean loss reporting a summed metric and a maximum (name ending ``_max``)."""
    mask = mb["response_mask"].float()
    lp = outputs["logprobs"]
    peak = torch.where(mask > 0, lp.detach(), torch.full_like(lp, -1e9)).max()
    return -(lp * mask).sum(), mask.sum(), {"tokens": mask.sum(), "logprob_max": peak}


def _metrics_once(rank, world_size, layout, init_dir):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine, save_engine

    ctx = initialize_parallel(tp=layout[0], pp=layout[1], vpp=layout[2], seed=11)
    engine = _engine(ctx, tied=False)
    if os.path.exists(init_dir):
        load_engine(engine, init_dir, load_optimizer=False)
    else:
        save_engine(engine, init_dir)
    result = engine.train_batch(fixed_batch(), max_and_sum_loss)
    destroy_parallel()
    return result.metrics


def test_a_metric_named_max_is_the_largest_over_micro_batches_and_ranks(oracle_world, world,
                                                                        tmp_path):
    init = str(tmp_path / "init")
    [ref] = oracle_world.run(_metrics_once, (1, 1, None), init)
    batch = fixed_batch()
    assert ref["tokens"] == 1.0  # summed, then divided by the units (the tokens)
    assert ref["logprob_max"] < 0  # a log-prob, not a sum of them over micro-batches
    for name in ("DP2", "PP2"):
        for got in world.run(_metrics_once, LAYOUTS[name], init):
            assert got["tokens"] == pytest.approx(1.0), name
            assert got["logprob_max"] == pytest.approx(ref["logprob_max"], rel=1e-5), name
    assert int(batch["response_mask"].sum()) > 0
