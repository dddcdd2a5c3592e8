"""HF config.json -> ModelSpec: what is read, what is refused (one line), RoPE as HF has it."""
import pytest
import torch

from mcore_rl.errors import UsageError
from mcore_rl.models.arch import ModelArch
from mcore_rl.models.hf_config import LM_HEAD, SCORE_HEAD, spec_from_hf_config
from mcore_rl.models.rope import rope_inv_freq
from tests.models.tiny_hf import COMMON, LLAMA3_ROPE, VARIANTS, hf_classes


def _hf_config(variant: str, **changes):
    family, overrides = VARIANTS[variant]
    config_cls = hf_classes(family)[0]
    config = config_cls(**{**COMMON, **overrides, **changes})
    config.architectures = [hf_classes(family)[1].__name__]
    return config


def test_tiny_variants_are_read_with_their_hf_values():
    for variant, (family, overrides) in VARIANTS.items():
        spec = spec_from_hf_config(_hf_config(variant).to_dict())
        arch = spec.arch
        assert (spec.family.model_type, spec.head) == (family, LM_HEAD)
        assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == \
            (overrides["vocab_size"], 128, 256, 2)
        assert (arch.num_attention_heads, arch.num_kv_heads, arch.kv_channels) == (4, 2, 32)
        assert arch.rms_norm_eps == pytest.approx(3e-5)
        assert arch.tie_word_embeddings == overrides["tie_word_embeddings"]
        assert arch.qkv_bias == (family == "qwen2")
        assert arch.qk_norm == (family == "qwen3")
        assert arch.padded_vocab_size % 128 == 0 and arch.padded_vocab_size >= arch.vocab_size
    llama3 = spec_from_hf_config(_hf_config("llama-tied").to_dict()).arch
    assert llama3.rope_theta == 50000.0 and llama3.rope_scaling.rope_type == "llama3"
    assert llama3.rope_scaling.original_max_position_embeddings == 64


def test_sequence_classification_with_one_label_gets_a_score_head():
    config = _hf_config("qwen2-tied", num_labels=1)
    config.architectures = ["Qwen2ForSequenceClassification"]
    assert spec_from_hf_config(config.to_dict()).head == SCORE_HEAD


def test_transformers_4_config_layout_is_read():
    raw = _hf_config("llama-untied").to_dict()
    raw.pop("rope_parameters")
    raw.update(rope_theta=12345.0, rope_scaling={"type": "linear", "factor": 2.0})
    arch = spec_from_hf_config(raw).arch
    assert arch.rope_theta == 12345.0 and arch.rope_scaling.rope_type == "linear"


LLAMA32_LIKE_ROPE = {**LLAMA3_ROPE, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 3.0}, LLAMA3_ROPE,
                                  LLAMA32_LIKE_ROPE])
def test_rope_inverse_frequencies_equal_hf(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    changes = {"rope_parameters": {"rope_theta": 50000.0, **(rope or {"rope_type": "default"})}}
    config = _hf_config("llama-untied", **changes)
    arch = spec_from_hf_config(config.to_dict()).arch
    hf = LlamaRotaryEmbedding(config)
    assert hf.attention_scaling == 1.0
    assert torch.equal(rope_inv_freq(arch), hf.inv_freq)


@pytest.mark.parametrize("variant,changes,fragment", [
    ("llama-untied", {"architectures": ["GPTNeoXForCausalLM"]},
     "architecture 'GPTNeoXForCausalLM' (supported: LlamaForCausalLM, "
     "LlamaForSequenceClassification, MistralForCausalLM"),
    ("llama-untied", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope type 'yarn' (supported: default, linear, llama3)"),
    ("mistral-untied", {"sliding_window": 64}, "sliding-window attention (sliding_window=64"),
    ("qwen2-tied", {"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
    ("llama-untied", {"attention_bias": True}, "attention_bias=true"),
    ("qwen3-untied", {"attention_bias": True}, "attention_bias=true"),
    ("qwen3-untied", {"use_sliding_window": True, "sliding_window": 64,
                      "layer_types": ["full_attention", "sliding_attention"]},
     "sliding-window attention"),
    ("llama-untied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama-untied", {"architectures": ["LlamaForSequenceClassification"], "num_labels": 3},
     "with 3 labels (supported: a single score"),
])
def test_unsupported_configs_are_refused_in_one_line(variant, changes, fragment):
    raw = _hf_config(variant).to_dict()
    if "num_labels" in changes:
        raw["id2label"] = {str(i): f"L{i}" for i in range(changes.pop("num_labels"))}
    raw.update(changes)
    with pytest.raises(UsageError) as err:
        spec_from_hf_config(raw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_mistral_window_as_long_as_the_context_is_accepted():
    raw = _hf_config("mistral-untied", sliding_window=256).to_dict()
    assert spec_from_hf_config(raw).family.model_type == "mistral"


def test_vocab_pad_multiple_grows_only_when_tp_does_not_divide_it():
    arch = ModelArch(vocab_size=1003, hidden_size=8, intermediate_size=8, num_layers=1,
                     num_attention_heads=1, num_kv_heads=1)
    assert arch.padded_vocab_size == 1024
    assert arch.with_vocab_multiple_for_tp(8) is arch
    assert arch.with_vocab_multiple_for_tp(3).padded_vocab_size == 1152  # multiple 384
    assert ModelArch.from_dict(arch.to_dict()) == arch


def _moe_config(variant: str, **changes) -> dict:
    from tests.models.tiny_moe import build_tiny_moe_model

    config = build_tiny_moe_model(variant).config
    raw = {**config.to_dict(), **changes}
    raw["architectures"] = [type(build_tiny_moe_model(variant)).__name__]
    return raw


@pytest.mark.parametrize("variant,family,norm,naming", [
    ("qwen3moe", "qwen3_moe", False, "qwen3_moe"),
    ("qwen3moe-norm", "qwen3_moe", True, "qwen3_moe"),
    ("mixtral", "mixtral", True, "mixtral"),
])
def test_moe_configs_are_read_with_their_experts_and_routing(variant, family, norm, naming):
    spec = spec_from_hf_config(_moe_config(variant))
    arch = spec.arch
    assert spec.family.model_type == family and arch.is_moe
    assert (arch.num_experts, arch.experts_per_token, arch.moe_intermediate_size) == (8, 2, 64)
    assert (arch.norm_topk_prob, arch.expert_naming) == (norm, naming)
    assert arch.qk_norm == (family == "qwen3_moe") and not arch.qkv_bias
    assert ModelArch.from_dict(arch.to_dict()) == arch


@pytest.mark.parametrize("variant,changes,fragment", [
    ("qwen3moe", {"mlp_only_layers": [1]}, "dense layers between expert layers"),
    ("qwen3moe", {"decoder_sparse_step": 2}, "dense layers between expert layers"),
    ("qwen3moe", {"num_experts_per_tok": 9}, "0 < num_experts_per_tok <= experts"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 (set it to 0)"),
    ("mixtral", {"sliding_window": 64}, "sliding-window attention (sliding_window=64"),
])
def test_unsupported_moe_configs_are_refused_in_one_line(variant, changes, fragment):
    with pytest.raises(UsageError) as err:
        spec_from_hf_config(_moe_config(variant, **changes))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_expert_layouts_that_do_not_split_the_experts_are_refused():
    from mcore_rl.models.provider import check_layout

    arch = spec_from_hf_config(_moe_config("qwen3moe")).arch
    check_layout(arch, tp=1, pp=2, ep=8)
    with pytest.raises(UsageError, match="EP 3 does not divide the 8 experts"):
        check_layout(arch, tp=1, pp=1, ep=3)
    with pytest.raises(UsageError, match="expert TP 3 does not divide the expert FFN size 64"):
        check_layout(arch, tp=1, pp=1, ep=1, etp=3)
    dense = spec_from_hf_config(_hf_config("qwen3-untied").to_dict()).arch
    with pytest.raises(UsageError, match="EP 2 needs a mixture-of-experts model"):
        check_layout(dense, tp=1, pp=1, ep=2)
