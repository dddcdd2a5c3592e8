"""Megatron's load-balancing loss (``aux_loss``) on a tiny Qwen3-MoE, checked by hand.

One rank (TP1 PP1), training mode, ``moe.aux_loss_coef`` 0.01: the per-layer value Megatron
records (``load_balancing_loss``, the loss before the coefficient) equals, within fp32
round-off, ``E * sum_i f_i * P_i`` computed here from the router's own input: ``f_i`` the
share of the T*k routing slots that chose expert i, ``P_i`` the mean softmax probability of
expert i over all experts. HF's ``load_balancing_loss_func`` on the same layer's router
logits is k times that value: HF does not divide by top-k (and over several layers it pools
their tokens into one sum rather than adding one loss per layer).
"""
import torch

from mcore_rl.models.moe import MoeOptions
from tests.models.tiny_hf import tokens
from tests.models.tiny_moe import save_tiny_moe_model
from tests.world import shared_world

COEF = 0.01


def _aux_losses(rank, world_size, hf_dir, toks):
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    ctx = initialize_parallel()
    try:
        built = build_model(hf_dir, ctx, moe=MoeOptions(aux_loss_coef=COEF))
        (chunk,) = built.chunks
        chunk.train()
        inputs, routers = [], []
        for layer in chunk.decoder.layers:
            router = layer.mlp.router
            routers.append(router.weight.detach().clone())
            router.register_forward_hook(lambda m, args, out: inputs.append(args[0].detach()))
        clear_aux_losses_tracker()
        chunk(toks, torch.arange(toks.shape[1]).expand_as(toks), None)
        recorded = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
        return recorded, inputs, routers
    finally:
        destroy_parallel()


def _by_hand(hidden: torch.Tensor, weight: torch.Tensor, top_k: int) -> torch.Tensor:
    x = hidden.reshape(-1, hidden.shape[-1]).float()
    probs = torch.softmax(x @ weight.float().t(), dim=-1)            # [T, E]
    chosen = probs.topk(top_k, dim=-1).indices                        # norm_topk_prob=False
    counts = torch.zeros(probs.shape[1]).index_add_(0, chosen.flatten(), torch.ones(chosen.numel()))
    T, E = probs.shape
    return E * ((counts / (T * top_k)) * probs.mean(0)).sum()


def test_megatron_aux_loss_is_the_switch_loss_per_layer_and_hf_is_k_times_it(tmp_path):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf_dir = save_tiny_moe_model("qwen3moe", tmp_path / "hf")
    toks = tokens(1001, batch=2, seq=16)
    recorded, inputs, routers = shared_world(1).run(_aux_losses, str(hf_dir), toks)[0]
    assert len(inputs) == len(routers) == 2
    for layer, (hidden, weight) in enumerate(zip(inputs, routers)):
        expected = _by_hand(hidden, weight, top_k=2)
        assert 1.0 < expected < 2.0  # 1 for perfectly balanced routing
        assert torch.allclose(recorded[layer], expected, rtol=1e-5), (layer, recorded, expected)
        logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()
        hf = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
        assert torch.allclose(hf, 2 * expected, rtol=1e-5), (layer, hf, expected)
