"""Mixture-of-experts layers on Megatron-Core: the router as HF computes it, and the options
that are not the checkpoint's to decide (token dispatcher, load-balancing loss).

Router, HF (Qwen3-MoE and Mixtral), per token with router logits l over E experts:
``p = softmax(l)`` in fp32, ``(w, experts) = topk(p, k)``, then ``w /= sum(w)`` when
``norm_topk_prob`` (Mixtral always). Megatron's ``TopKRouter`` reproduces both settings:

- ``norm_topk_prob=True`` (and Mixtral): ``w_j = exp(l_j) / sum over the top k of exp(l)`` is
  the softmax over the top-k logits, which is ``moe_router_pre_softmax=False`` (top-k on the
  logits, then softmax over those k). Softmax is monotone, so the experts are the same.
- ``norm_topk_prob=False`` (the Qwen3-MoE default): ``moe_router_pre_softmax=True`` (softmax
  over all E, top-k of the probabilities, used as they are: no ``topk_scaling_factor``).

Both with the softmax score function, no expert bias, no group-limited routing and the
router math in fp32 (``moe_router_dtype``: HF takes the softmax in fp32 but the gate matmul
in the model dtype, so fp32 models agree to round-off and bf16 ones differ by the rounding of
the logits). Dropless (no capacity factor). Experts run one MLP each (``SequentialMLP``; no
grouped GEMM, which needs CUDA kernels), and the expert output is the routing-weighted sum
of the chosen experts' SwiGLU outputs, as in HF.

Load-balancing loss (``aux_loss_coef`` > 0): Megatron's, added by every MoE layer on its own
micro-batch tokens: ``coef * E * sum_i f_i * P_i`` with ``f_i`` the share of the T*k routing
slots that chose expert i and ``P_i`` the mean over tokens of expert i's softmax probability
(over all experts). HF's ``load_balancing_loss_func`` (``router_aux_loss_coef``) differs: it
does not divide by k (one layer's HF value is k times Megatron's), and it pools the tokens of
all layers into one sum instead of adding one loss per layer. The coefficient is therefore
not HF's ``router_aux_loss_coef`` and is not read from the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.models.arch import ModelArch

DISPATCHERS = ("alltoall", "allgather")
"""Megatron token dispatchers that run here (both probed on gloo, EP2, TP2 x EP2)."""


@dataclass(frozen=True)
class MoeOptions:
    """How mixture-of-experts layers run (not part of the checkpoint)."""

    dispatcher: str = "alltoall"
    """Megatron token dispatcher moving tokens to the ranks holding their experts: one of
    `DISPATCHERS`."""
    aux_loss_coef: float = 0.0
    """Coefficient of Megatron's load-balancing loss (``aux_loss``); 0 turns it off."""
    routing_replay: bool = False
    """Give every router the means to record and replay its choices
    (`mcore_rl.train.routing_replay`); routing is unchanged until a pass asks for either."""


def moe_config_fields(arch: ModelArch, ep: int, expert_tp: int,
                      options: MoeOptions | None = None) -> dict:
    """Megatron ``TransformerConfig`` fields of a mixture-of-experts ``arch``; empty if dense."""
    if not arch.is_moe:
        return {}
    options = options or MoeOptions()
    if options.dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown MoE token dispatcher {options.dispatcher!r} "
                         f"(supported: {', '.join(DISPATCHERS)})")
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.experts_per_token,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type=options.dispatcher,
        moe_router_load_balancing_type="aux_loss" if options.aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=options.aux_loss_coef,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
        moe_enable_routing_replay=options.routing_replay,
    )
