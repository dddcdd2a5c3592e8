"""One `train_batch` of a mixture-of-experts model gives the same parameters at EP2 as on one rank.

Tiny Qwen3-MoE-shaped model (8 experts, top-2, QK norm), random weights written by the
single-rank oracle; the same fixed batch (several micro-batches of unequal token counts), SGD
without clipping (the update is the gradient, so a wrongly scaled expert gradient shows),
trained at EP2 (DP2 for the dense part, each EP rank holding 4 experts) with both token
dispatchers. The saved models are compared tensor by tensor at EP1 within 1e-5 relative.
A second batch splits into 4 micro-batches on one DP rank and 3 on the other: every EP rank
must still run the same micro-batches (the short one gets an all-padding one).
"""
import os

import pytest
import torch

from mcore_rl.models import ModelArch
from tests.train.test_engine_layouts import (VOCAB, fixed_batch, max_relative_difference,
                                             token_mean_loss)
from tests.world import shared_world

ARCH = ModelArch(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                 num_experts=8, experts_per_token=2, moe_intermediate_size=32,
                 norm_topk_prob=False, expert_naming="qwen3_moe")
LAYOUTS = {"EP2-alltoall": (2, "alltoall"), "EP2-allgather": (2, "allgather")}


def uneven_batch():
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(8)
    lengths = [28, 4, 18, 34, 33, 27, 21, 32]  # 4 and 3 micro-batches of <= 48 tokens at DP2
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return Batch.from_sequences(seqs, prompt_lens=[3, 1, 2, 5, 4, 3, 2, 6])


BATCHES = {"even": fixed_batch, "uneven": uneven_batch}


AUX_LOSS = 0.05


def _engine(ctx, dispatcher, aux: float = 0.0, tokens: int = 48, packing: bool = False):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.models.moe import MoeOptions
    from mcore_rl.train.build import build_engine

    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=tokens)
    chunks = build_gpt_chunks(ARCH, ctx, moe=MoeOptions(dispatcher=dispatcher, aux_loss_coef=aux,
                                                        routing_replay=True))
    return build_engine(chunks, ctx, vocab_size=VOCAB, optim=optim, packing=packing)


def _train_once(rank, world_size, ep, dispatcher, batch, init_dir, out_dir, aux=0.0, routes=None,
                tp=1, packing=False):
    """One SGD step; ``routes`` (recorded on one rank) replayed when given. With ``routes
    == "record"``: record the batch's routes first (one rank) and return them too."""
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine, save_engine
    from mcore_rl.train.routing_replay import ROUTES

    ctx = initialize_parallel(tp=tp, ep=ep, seed=11)
    # With the aux loss on, one sequence per micro-batch (34 tokens): every layout runs the
    # same micro-batches, as the load-balancing loss is a statistic of its micro-batch.
    engine = _engine(ctx, dispatcher, aux, tokens=34 if aux else 48, packing=packing)
    if os.path.exists(init_dir):
        load_engine(engine, init_dir, load_optimizer=False)
    else:
        save_engine(engine, init_dir)
    data = BATCHES[batch]()
    if isinstance(routes, str):
        routes = engine.forward(data, record_routes=True)[ROUTES]
    if routes is not None:
        data = data.with_tensors(routes=routes)
    result = engine.train_batch(data, token_mean_loss)
    save_engine(engine, out_dir)
    destroy_parallel()
    return result.loss, result.units, result.metrics, routes


def _model_tensors(rank, world_size, path):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.checkpoint import load_engine

    ctx = initialize_parallel(seed=3)
    engine = _engine(ctx, "alltoall")
    load_engine(engine, path, load_optimizer=False)
    state = {k: v.detach().clone() for k, v in engine.model[0].module.state_dict().items()
             if torch.is_tensor(v) and "_extra_state" not in k}
    destroy_parallel()
    return state


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_one_train_batch_of_a_moe_model_updates_parameters_identically_at_ep2(tmp_path, batch):
    from mcore_rl.train.micro_batches import pack_micro_batches, split_for_data_parallel

    lens = BATCHES[batch]().seq_lens
    counts = [len(pack_micro_batches(lens, split_for_data_parallel(lens, 2)[r], 48))
              for r in range(2)]
    assert counts == ([4, 3] if batch == "uneven" else [2, 2])
    oracle, world = shared_world(1), shared_world(2)
    init = str(tmp_path / "init")
    (ref_loss, ref_units, _, _), = oracle.run(_train_once, 1, "alltoall", batch, init,
                                              str(tmp_path / "oracle"))
    before = oracle.run(_model_tensors, init)[0]
    expected = oracle.run(_model_tensors, str(tmp_path / "oracle"))[0]
    assert any(".experts." in k for k in expected)
    moved, _ = max_relative_difference(expected, before)
    assert moved > 1e-3, "the step must change the parameters visibly"
    layouts = {name: (ep, dispatcher, False) for name, (ep, dispatcher) in LAYOUTS.items()}
    if batch == "uneven":  # packed: one length for every micro-batch, an all-padding one
        layouts["EP2-allgather-packed"] = (2, "allgather", True)
    for name, (ep, dispatcher, packing) in layouts.items():
        out = str(tmp_path / name)
        for step_loss, units, _, _ in world.run(_train_once, ep, dispatcher, batch, init, out,
                                                packing=packing):
            assert units == ref_units
            assert step_loss == pytest.approx(ref_loss, rel=1e-5)
        got = oracle.run(_model_tensors, out)[0]
        diff, where = max_relative_difference(got, expected)
        assert diff <= 1e-5, f"{name}: parameters differ from EP1 by {diff:.2e} (worst: {where})"


def test_with_the_aux_loss_on_and_routes_replayed_ep2_and_tp2xep2_update_parameters_as_one_rank(
        tmp_path):
    """Megatron's load-balancing loss in the gradient (the same micro-batches in every
    layout: one sequence each, four per EP rank), and every rank routing each token as the
    one-rank run did (so round-off cannot flip a near tie between the layouts)."""
    oracle, world = shared_world(1), shared_world(2)
    init = str(tmp_path / "init")
    (ref_loss, _, ref_metrics, routes), = oracle.run(
        _train_once, 1, "alltoall", "uneven", init, str(tmp_path / "oracle"), AUX_LOSS, "record")
    assert ref_metrics["moe/load_balancing_loss"] > 0
    expected = oracle.run(_model_tensors, str(tmp_path / "oracle"))[0]
    layouts = {**{name: (ep, d, 1, world) for name, (ep, d) in LAYOUTS.items()},
               # TP2 x EP2 on 4 ranks: sequence-parallel (Megatron's rule for experts under
               # TP), the experts split over the TP ranks too (etp = tp)
               "TP2xEP2-alltoall": (2, "alltoall", 2, shared_world(4))}
    for name, (ep, dispatcher, tp, ranks) in layouts.items():
        out = str(tmp_path / name)
        for step_loss, _, metrics, _ in ranks.run(_train_once, ep, dispatcher, "uneven", init, out,
                                                  AUX_LOSS, routes, tp):
            assert step_loss == pytest.approx(ref_loss, rel=1e-5)
        got = oracle.run(_model_tensors, out)[0]
        diff, where = max_relative_difference(got, expected)
        assert diff <= 1e-5, f"{name}: parameters differ from EP1 by {diff:.2e} (worst: {where})"
