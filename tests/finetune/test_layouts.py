"""One DPO, KTO and RM step gives the same updated parameters at TP2, PP2, DP2 and
PP2xVPP2 as on one rank, over uneven micro-batches that pairs must not be split across.

As in tests/train/test_engine_layouts.py: every layout starts from the oracle's initial
weights, trains one fixed batch with SGD (no clipping: a mis-scaled gradient shows) and the
saved results are compared at TP1. The job's own loss function runs; its pair matching
raises if a micro-batch ever held one side of a pair without the other.
"""
import os

import pytest
import torch

from mcore_rl.models import ModelArch
from tests.train.test_engine_layouts import LAYOUTS, max_relative_difference
from tests.world import shared_world

VOCAB = 64
ARCH = ModelArch(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=4,
                 num_attention_heads=4, num_kv_heads=2)
JOBS = ("dpo", "kto", "rm")


def _cfg(job):
    from mcore_rl.config import RLConfig

    cfg = RLConfig()
    cfg.train.job = job
    cfg.finetune.beta = 0.5
    cfg.finetune.desirable_weight, cfg.finetune.undesirable_weight = 1.5, 0.7
    return cfg


def fixed_batch(job):
    """Six pairs (dpo, rm) or ten labelled completions (kto) of uneven lengths, with fixed
    reference log-probs (and KTO reference point)."""
    from mcore_rl.data.finetune_batch import completion_batch, pair_batch
    from mcore_rl.data.finetune_records import Completion, Pair

    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()
    if job == "kto":
        lengths = [(3, 4), (2, 9), (5, 2), (1, 12), (4, 6), (2, 3), (6, 7), (3, 1), (2, 5), (1, 8)]
        batch = completion_batch([Completion(ids(p), ids(c), desirable=k % 3 != 0)
                                  for k, (p, c) in enumerate(lengths)], 0)
        batch.info["kto_reference_point"] = 0.3
    else:
        lengths = [(3, 4, 9), (2, 12, 3), (5, 2, 2), (1, 7, 14), (4, 6, 5), (2, 3, 8)]
        batch = pair_batch([Pair(ids(p), ids(c), ids(r), margin=0.1 * k)
                            for k, (p, c, r) in enumerate(lengths)], 0)
    return batch.with_tensors(ref_logps=-torch.rand(len(batch), generator=g) * 20)


def _engine(ctx, job):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.train.build import build_engine

    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=40)
    head, kind = ("score", "reward") if job == "rm" else ("lm", "lm")
    return build_engine(build_gpt_chunks(ARCH, ctx, head=head), ctx, kind=kind, vocab_size=VOCAB,
                        optim=optim)


def _train_once(rank, world_size, layout, job, init_dir, out_dir):
    from mcore_rl.finetune.setup import build_job
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine, save_engine

    tp, pp, vpp = layout
    ctx = initialize_parallel(tp=tp, pp=pp, vpp=vpp, seed=11)
    engine = _engine(ctx, job)
    if os.path.exists(init_dir):
        load_engine(engine, init_dir, load_optimizer=False)
    else:
        save_engine(engine, init_dir)
    batch = fixed_batch(job)
    job_obj = build_job(_cfg(job))
    result = engine.train_batch(batch, job_obj.loss_fn())
    save_engine(engine, out_dir)
    n_micro = len(engine._plan(batch))
    destroy_parallel()
    return result.loss, result.units, job_obj.step_metrics(dict(result.metrics)), n_micro


def _model_tensors(rank, world_size, job, path):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine

    ctx = initialize_parallel(seed=3)
    engine = _engine(ctx, job)
    load_engine(engine, path, load_optimizer=False)
    state = {k: v.detach().clone() for k, v in engine.model[0].module.state_dict().items()
             if torch.is_tensor(v) and "_extra_state" not in k}
    destroy_parallel()
    return state


@pytest.mark.parametrize("job", JOBS)
def test_one_step_updates_parameters_identically_at_every_layout(tmp_path, job):
    one, two = shared_world(1), shared_world(2)
    init = str(tmp_path / "init")
    (ref_loss, ref_units, ref_metrics, ref_micro), = one.run(
        _train_once, (1, 1, None), job, init, str(tmp_path / "oracle"))
    assert ref_micro >= 3, "the batch must span several micro-batches"
    assert ref_units == (10 if job == "kto" else 6)
    before = one.run(_model_tensors, job, init)[0]
    expected = one.run(_model_tensors, job, str(tmp_path / "oracle"))[0]
    assert max_relative_difference(expected, before)[0] > 1e-3, "the step must move the weights"
    for name, layout in LAYOUTS.items():
        out = str(tmp_path / name)
        for loss, units, metrics, _ in two.run(_train_once, layout, job, init, out):
            assert units == ref_units
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert metrics == pytest.approx(ref_metrics, rel=1e-5, abs=1e-6)
        got = one.run(_model_tensors, job, out)[0]
        diff, where = max_relative_difference(got, expected)
        assert diff <= 1e-5, f"{job} {name}: parameters differ from one rank by {diff:.2e} ({where})"
