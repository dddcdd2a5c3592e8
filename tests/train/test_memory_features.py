"""Activation recompute (selective and full) and the distributed optimizer trade memory for
compute or communication, never results: two Adam steps at DP2 give the plain run's losses
and parameters to round-off, and the recompute really runs (the recomputed modules run a
second forward in backward)."""
import pytest
import torch

from tests.train.test_engine_layouts import VOCAB, arch, fixed_batch, max_relative_difference, token_mean_loss
from tests.world import shared_world

VARIANTS = {"plain": ("none", False), "recompute_full": ("full", False),
            "recompute_selective": ("selective", False), "distributed_optimizer": ("none", True)}


def _train(rank, world_size, recompute, distributed, dtype):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine
    from mcore_rl.train.fused_head import unwrap

    ctx = initialize_parallel(seed=5)  # DP2
    optim = OptimizerConfig(name="adam", lr=1e-2, clip_grad=1.0, micro_batch_tokens=48, distributed=distributed)
    engine = build_engine(build_gpt_chunks(arch(False), ctx, dtype=dtype, recompute=recompute), ctx,
                          vocab_size=VOCAB, optim=optim)
    calls = {"layer": 0, "core_attention": 0}

    def count(kind):
        def hook(module, args):
            calls[kind] += 1
        return hook

    model = unwrap(engine.model[0])
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(count("layer"))
        layer.self_attention.core_attention.register_forward_pre_hook(count("core_attention"))
    losses = [engine.train_batch(fixed_batch(), token_mean_loss).loss for _ in range(2)]
    micro = len(engine._plan(fixed_batch()))
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    destroy_parallel()
    return losses, params, {k: v / (2 * micro * len(model.decoder.layers)) for k, v in calls.items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_recompute_and_the_distributed_optimizer_equal_the_plain_run(dtype):
    world = shared_world(2)
    results = {name: world.run(_train, recompute, distributed, dtype)[0]
               for name, (recompute, distributed) in VARIANTS.items()}
    plain_losses, plain_params, plain_calls = results["plain"]
    assert plain_calls == {"layer": 1, "core_attention": 1}
    tol = 1e-5 if dtype == "fp32" else 1e-2  # bf16: round-off of a different order of operations
    for name, (losses, params, calls) in results.items():
        assert losses == pytest.approx(plain_losses, rel=tol), name
        worst, where = max_relative_difference(params, plain_params)
        assert worst < tol, f"{name}: {where} {worst}"
    # forwards per layer and micro-batch: the recomputed module runs again in backward
    assert results["recompute_full"][2] == {"layer": 2, "core_attention": 2}
    assert results["recompute_selective"][2] == {"layer": 1, "core_attention": 2}
    assert results["distributed_optimizer"][2] == {"layer": 1, "core_attention": 1}


def saved_bytes(fn):
    """``fn()``'s result and the bytes of the distinct storages autograd saved for backward
    while it ran (activations, plus the weights some ops save: equal between two layouts of
    the same model, so differences are activations)."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _tp2(rank, world_size, sequence_parallel, fused):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine
    from mcore_rl.train.fused_head import unwrap

    ctx = initialize_parallel(tp=2, seed=5)
    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=4096)
    engine = build_engine(build_gpt_chunks(arch(False), ctx, sequence_parallel=sequence_parallel), ctx,
                          vocab_size=VOCAB, optim=optim, fused_lm_head=fused)
    assert engine.model[0].config.sequence_parallel == sequence_parallel
    out = engine.forward(fixed_batch(), temperature=0.7, with_entropy=True)
    result, nbytes = saved_bytes(lambda: engine.train_batch(fixed_batch(), token_mean_loss))
    params = {n: p.detach().clone() for n, p in unwrap(engine.model[0]).named_parameters()}
    destroy_parallel()
    return out, result.loss, params, nbytes


@pytest.mark.parametrize("fused", [True, False], ids=["fused_head", "output_layer"])
def test_sequence_parallel_equals_tensor_parallel_without_it_and_saves_activations(fused):
    world = shared_world(2)
    with_sp = world.run(_tp2, True, fused)
    without = world.run(_tp2, False, fused)
    response = fixed_batch()["response_mask"].bool()
    for rank in range(2):
        (out, loss, params, sp_bytes), (ref_out, ref_loss, ref_params, plain_bytes) = with_sp[rank], without[rank]
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(out[key][response], ref_out[key][response], rtol=1e-5, atol=1e-5)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        worst, where = max_relative_difference(params, ref_params)
        assert worst < 1e-5, f"rank {rank}: {where} {worst}"
        # the norms, residuals and the hidden states between blocks hold 1/tp of the sequence
        assert sp_bytes < 0.9 * plain_bytes, (sp_bytes, plain_bytes)
    print(f"saved for backward per rank: {with_sp[0][3] / 2**20:.2f} MiB with sequence parallelism, "
          f"{without[0][3] / 2**20:.2f} MiB without")
