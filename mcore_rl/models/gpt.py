"""Megatron-Core GPT models from a `ModelArch`: the local spec on CPU, TE spec on GPU.

Model code only: no RL, engine or launch logic. Parallel sizes come in through the
`ParallelContext`. Two heads: ``"lm"`` (vocabulary logits, padded to
``arch.padded_vocab_size``; see `mcore_rl.models.vocab`) and ``"score"`` (a scalar per
token: critic values / reward scores, `mcore_rl.models.value_head`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_rl.models.arch import ModelArch
from mcore_rl.models.moe import MoeOptions, moe_config_fields
from mcore_rl.parallel import ParallelContext, megatron_cpu_compat

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


RECOMPUTE = ("none", "selective", "full")


def recompute_fields(recompute: str) -> dict:
    """``TransformerConfig`` fields of an activation-recompute mode: ``full`` recomputes each
    layer from its input (one layer per checkpoint), ``selective`` core attention only."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


def build_transformer_config(arch: ModelArch, ctx: ParallelContext, dtype: str = "fp32",
                             recompute: str = "none", init_weights: bool = True,
                             moe: MoeOptions | None = None, sequence_parallel: bool = False):
    """Megatron ``TransformerConfig`` for ``arch``, with every HF-differing default explicit.

    ``init_weights=False`` skips random initialisation (weights are loaded right after).
    ``moe``: how expert layers run (`mcore_rl.models.moe`); ignored for dense models.
    """
    from megatron.core.transformer import TransformerConfig

    params_dtype = DTYPES[dtype]
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        # Megatron defaults that differ from HF Llama/Qwen2/Mistral:
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        # HF computes the attention softmax in fp32 for bf16 models too.
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=ctx.tp,
        pipeline_model_parallel_size=ctx.pp,
        virtual_pipeline_model_parallel_size=ctx.vpp,
        context_parallel_size=getattr(ctx, "cp", 1),
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=ctx.device.type == "cpu",
        perform_initialization=init_weights,
        **recompute_fields(recompute),
        # Megatron trains expert layers under tensor parallelism only with the sequence
        # split over the TP ranks between the tensor-parallel blocks.
        sequence_parallel=uses_sequence_parallel(arch, ctx.tp, sequence_parallel),
        **moe_config_fields(arch, ctx.ep, ctx.expert_tp, moe),
        **megatron_cpu_compat.transformer_config_overrides(),
    )


def uses_sequence_parallel(arch: ModelArch, tp: int, requested: bool = False) -> bool:
    """Whether the model runs sequence-parallel (the sequence split over the TP ranks outside
    the tensor-parallel blocks): under tensor parallelism, when asked for
    (``parallel.sequence_parallel``) and always for a mixture-of-experts model."""
    return tp > 1 and (requested or arch.is_moe)


def layer_spec(arch: ModelArch, transformer_engine: bool | None = None,
               sequence_parallel: bool = False):
    """The TE spec when Transformer Engine and CUDA are present, else the local spec (with
    PyTorch's fused attention, `mcore_rl.models.sdpa_attention`, and norms that run
    sequence-parallel, `mcore_rl.models.norms`, where it is on)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if transformer_engine is None:
        from mcore_rl.models.te_shim import transformer_engine_usable

        transformer_engine = transformer_engine_usable()
    if transformer_engine:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts or None, moe_grouped_gemm=False,
            qk_layernorm=arch.qk_norm)
    spec = specs.get_gpt_layer_local_spec(num_experts=arch.num_experts or None,
                                          moe_grouped_gemm=False, normalization="RMSNorm",
                                          qk_layernorm=arch.qk_norm)
    # PyTorch's fused attention instead of Megatron's, which keeps every head's [s, s] scores
    from mcore_rl.models.sdpa_attention import SDPAttention

    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if sequence_parallel:
        from mcore_rl.models.norms import LocalRMSNorm, SequenceParallelRMSNorm

        spec.submodules.input_layernorm = SequenceParallelRMSNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        if arch.qk_norm:
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = LocalRMSNorm
    return spec


def block_spec(spec, config, ctx: ParallelContext, vp_stage: int | None):
    """The decoder of one chunk: the layer spec as it is, or under sequence parallelism with
    the sequence-parallel final norm too (local spec)."""
    if not config.sequence_parallel or not hasattr(spec, "submodules") or \
            not hasattr(spec.submodules, "input_layernorm"):
        return spec
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    from mcore_rl.models.norms import SequenceParallelRMSNorm

    if spec.submodules.input_layernorm is not SequenceParallelRMSNorm:
        return spec  # Transformer Engine's norms run sequence-parallel themselves
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=ctx.pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelRMSNorm)


def build_gpt_chunks(arch: ModelArch, ctx: ParallelContext, dtype: str = "fp32",
                     recompute: str = "none", transformer_engine: bool | None = None,
                     head: str = "lm", init_weights: bool = True, seed: int = 1234,
                     moe: MoeOptions | None = None, sequence_parallel: bool = False) -> list:
    """This rank's model chunks (one per virtual pipeline stage; one without VPP).

    ``head="lm"``: GPTModel with vocabulary logits [b, s, Vp/tp] on the last stage.
    ``head="score"``: `GPTValueModel`, values [b, s] on the last stage (the scalar head is
    initialised from ``seed``, identically on every rank). RoPE frequencies are set from
    ``arch`` exactly as HF computes them (`mcore_rl.models.rope`).
    """
    from megatron.core.models.gpt import GPTModel

    from mcore_rl.models.rope import apply_rope_frequencies
    from mcore_rl.models.value_head import GPTValueModel

    if head not in ("lm", "score"):
        raise ValueError(f"head must be 'lm' or 'score', not {head!r}")
    config = build_transformer_config(arch, ctx, dtype, recompute, init_weights, moe, sequence_parallel)
    spec = layer_spec(arch, transformer_engine, config.sequence_parallel)
    n_chunks = ctx.vpp or 1
    chunks = []
    for vp_stage in range(n_chunks):
        first = ctx.is_first_stage and vp_stage == 0
        last = ctx.is_last_stage and vp_stage == n_chunks - 1
        kwargs = dict(
            vocab_size=arch.padded_vocab_size, max_sequence_length=arch.max_position_embeddings,
            pre_process=first, post_process=last, position_embedding_type="rope",
            rotary_base=arch.rope_theta, vp_stage=vp_stage if ctx.vpp else None)
        decoder = block_spec(spec, config, ctx, vp_stage if ctx.vpp else None)
        if head == "lm":
            model = GPTModel(config, decoder,
                             share_embeddings_and_output_weights=arch.tie_word_embeddings,
                             **kwargs)
        else:
            model = GPTValueModel(config, decoder, head_seed=seed, **kwargs)
        # Megatron creates norm weights in fp32 whatever params_dtype says; cast every
        # parameter (as Megatron's Float16Module does) so a bf16 model is bf16 throughout,
        # as HF's is, and round-trips bit for bit.
        model = model.to(device=ctx.device, dtype=DTYPES[dtype])
        apply_rope_frequencies(model, arch)
        chunks.append(model)
    return chunks
