"""The engine's fused LM head (log-probs at response tokens only, `mcore_rl.train.fused_head`)
gives what Megatron's own output layer + `token_logprobs` give at every position: the same
log-probs and entropy on response tokens, and the same updated parameters after a step.
Vocab-parallel (TP2), tied and untied embeddings; the oracle is the unfused path."""
import pytest
import torch

from tests.train.test_engine_layouts import arch, fixed_batch, max_relative_difference, token_mean_loss
from tests.world import shared_world


def _run(rank, world_size, tied, fused):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine
    from tests.train.test_engine_layouts import VOCAB

    ctx = initialize_parallel(tp=2, seed=5)
    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=48)
    engine = build_engine(build_gpt_chunks(arch(tied), ctx), ctx, vocab_size=VOCAB - 3, optim=optim,
                          fused_lm_head=fused)
    batch = fixed_batch()
    out = engine.forward(batch, temperature=0.7, with_entropy=True)
    engine.train_batch(batch, token_mean_loss, temperature=0.7, with_entropy=True)
    params = {n: p.detach().clone() for n, p in engine.model[0].module.named_parameters()}
    destroy_parallel()
    return out, params


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_head_equals_the_output_layer_path_on_response_tokens_and_in_the_update(tied):
    world = shared_world(2)
    (fused, fused_params), _ = world.run(_run, tied, True)
    (plain, plain_params), _ = world.run(_run, tied, False)
    response = fixed_batch()["response_mask"].bool()
    for key in ("logprobs", "entropy"):
        assert torch.allclose(fused[key][response], plain[key][response], atol=1e-5, rtol=1e-5), key
        assert (fused[key][~response] == 0).all()
        assert plain[key][~response & fixed_batch()["attention_mask"][:, :].bool()].abs().sum() > 0
    worst, where = max_relative_difference(fused_params, plain_params)
    assert worst < 1e-5, f"{where}: {worst}"


def _run_truncated(rank, world_size, fused):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine
    from tests.train.test_engine_layouts import VOCAB

    ctx = initialize_parallel(tp=2, seed=5)
    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=48)
    engine = build_engine(build_gpt_chunks(arch(False), ctx), ctx, vocab_size=VOCAB - 3, optim=optim,
                          fused_lm_head=fused)
    batch = fixed_batch()
    trunc = dict(temperature=0.7, top_k=5, top_p=0.9)
    out = engine.forward(batch, with_entropy=True, **trunc)
    # a reported kept set of one token, the token itself: log-prob 0, entropy 0
    itself = batch.with_tensors(kept_ids=(batch["input_ids"] + 1)[..., None].to(torch.int32))
    replayed = engine.forward(itself, with_entropy=True, **trunc)
    engine.train_batch(batch, token_mean_loss, with_entropy=True, **trunc)
    params = {n: p.detach().clone() for n, p in engine.model[0].module.named_parameters()}
    destroy_parallel()
    return out, replayed, params


def test_truncated_log_probs_through_both_heads_and_a_reported_kept_set_at_tp2():
    world = shared_world(2)
    (fused, fused_replayed, fused_params), _ = world.run(_run_truncated, True)
    (plain, plain_replayed, plain_params), _ = world.run(_run_truncated, False)
    response = fixed_batch()["response_mask"].bool()
    for key in ("logprobs", "entropy", "kept"):
        assert torch.allclose(fused[key][response], plain[key][response], atol=1e-5, rtol=1e-5), key
    assert 0 < fused["kept"][response].mean() < 1, "top-5 of a random model keeps some tokens, not all"
    for replayed in (fused_replayed, plain_replayed):
        assert replayed["logprobs"][response].abs().max() < 1e-6
        assert replayed["entropy"][response].abs().max() < 1e-6 and bool((replayed["kept"][response] == 1).all())
    worst, where = max_relative_difference(fused_params, plain_params)
    assert worst < 1e-5, f"{where}: {worst}"
