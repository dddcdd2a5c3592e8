"""The local spec's core attention (`mcore_rl.models.sdpa_attention`, PyTorch's fused kernel)
computes what Megatron's `DotProductAttention` computes: the same outputs and the same
gradients for queries, keys and values, with grouped-query heads split over TP ranks, causal
or under an explicit boolean mask (the shared-prompt layout's). Where the fused kernel does
not apply (queries shorter than the keys) it hands over to Megatron's implementation
unchanged."""
import torch

from tests.world import shared_world


def _compare(rank, world_size):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_rl.models.arch import ModelArch
    from mcore_rl.models.gpt import build_transformer_config
    from mcore_rl.models.sdpa_attention import SDPAttention
    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    ctx = initialize_parallel(tp=2, seed=3)
    try:
        arch = ModelArch(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_attention_heads=8, num_kv_heads=2)
        config = build_transformer_config(arch, ctx)
        kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self")
        ours, megatron = SDPAttention(**kw), DotProductAttention(**kw)
        heads, groups, d = 8 // 2, 2 // 2, 64 // 8  # per TP rank
        g = torch.Generator().manual_seed(rank)
        s, b = 13, 3
        inputs = [torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups)]
        results = {}
        for name, module in (("ours", ours), ("megatron", megatron)):
            q, k, v = (t.clone().requires_grad_(True) for t in inputs)
            out = module(q, k, v, None)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            results[name] = (out.detach(), q.grad, k.grad, v.grad)
        # A boolean mask tensor (True: masked), as the shared-prompt layout passes one
        mask = torch.rand(b, 1, s, s, generator=g) > 0.7
        mask |= torch.ones(s, s, dtype=torch.bool).triu(1)
        mask[..., 0] = False  # every query sees at least the first key
        masked = []
        for module in (ours, megatron):
            q, k, v = (t.clone().requires_grad_(True) for t in inputs)
            out_m = module(q, k, v, mask)
            (out_m * torch.linspace(-1, 1, out_m.numel()).view_as(out_m)).sum().backward()
            masked.append((out_m.detach(), q.grad, k.grad, v.grad))
        # Queries shorter than the keys (causal alignment differs): Megatron's path too
        short = [m(inputs[0][-1:], inputs[1], inputs[2], None) for m in (ours, megatron)]
    finally:
        destroy_parallel()
    return results, masked, short


def test_fused_attention_equals_megatrons_in_outputs_and_gradients():
    world = shared_world(2)
    for results, masked, short in world.run(_compare):
        (out, *grads), (ref, *ref_grads) = results["ours"], results["megatron"]
        assert out.shape == ref.shape == (13, 3, 4 * 8)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for name, a, r in zip("qkv", grads, ref_grads):
            assert r.abs().sum() > 0
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"d{n}: {m}")
        for a, r in zip(*masked):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(masked[0][0], out)  # the mask took effect
        assert torch.equal(short[0], short[1])
