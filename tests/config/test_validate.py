"""Layout checks against the model and the world size, before any rank starts."""
import json

import pytest

from mcore_rl.config import load_config, validate_config
from mcore_rl.errors import ConfigError
from mcore_rl.models.shape import model_shape

# The inline default model: 2 layers, 4 attention heads, 2 KV heads.


def check(overrides, world_size=None):
    cfg = load_config(None, overrides)
    return validate_config(cfg, world_size=world_size, shape=model_shape(cfg.model))


def test_tp_not_dividing_attention_heads_names_field_and_choices():
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide the model's 4 attention "
                                          r"heads; choose one of 1, 2, 4"):
        check(["parallel.tp=3"])


def test_tp_not_dividing_kv_heads_is_rejected_since_megatron_does_not_replicate_them():
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide the model's 2 KV heads"):
        check(["parallel.tp=4"])


def test_pp_not_dividing_layers_is_rejected():
    with pytest.raises(ConfigError, match=r"parallel.pp=3 does not divide the model's 2 layers"):
        check(["parallel.pp=3"])


@pytest.mark.parametrize("overrides, message", [
    (["parallel.vpp=2"], r"needs parallel.pp >= 2"),
    (["parallel.pp=2", "parallel.vpp=2"], r"pp\*vpp=4 does not divide the model's 2 layers"),
    (["parallel.pp=2", "parallel.vpp=0"], r"parallel.vpp must be >= 1"),
])
def test_virtual_pipeline_that_does_not_fit_is_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(overrides)


def test_virtual_pipeline_that_fits_is_accepted():
    check(["parallel.pp=2", "parallel.vpp=2", "model.num_layers=8"], world_size=2)


def test_world_size_must_equal_tp_pp_dp():
    with pytest.raises(ConfigError, match=r"tp\*pp\*dp = 2\*1\*2 = 4 ranks, but the world has 2"):
        check(["parallel.tp=2", "parallel.dp=2"], world_size=2)
    with pytest.raises(ConfigError, match=r"world size 3 is not a multiple of tp\*pp = 2"):
        check(["parallel.tp=2"], world_size=3)
    check(["parallel.tp=2"], world_size=4)  # dp inferred as 2


def test_heads_are_read_from_the_checkpoint_config_when_a_path_is_given(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
         "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
         "num_hidden_layers": 30, "max_position_embeddings": 2048}))
    check([f"model.path={tmp_path}", "parallel.tp=3"])
    with pytest.raises(ConfigError, match=r"parallel.tp=2 does not divide the model's 9 attention"):
        check([f"model.path={tmp_path}", "parallel.tp=2"])


def _write_hf_config(path, variant, **changes):
    from tests.models.tiny_hf import COMMON, VARIANTS, hf_classes

    family, overrides = VARIANTS[variant]
    config_cls, lm_cls, _ = hf_classes(family)
    raw = config_cls(**{**COMMON, **overrides, **changes}).to_dict()
    raw["architectures"] = [lm_cls.__name__]
    (path / "config.json").write_text(json.dumps(raw))


def test_a_qwen3_checkpoint_is_accepted_and_its_options_checked(tmp_path):
    _write_hf_config(tmp_path, "qwen3-untied", max_position_embeddings=512)
    check([f"model.path={tmp_path}", "parallel.tp=2"], world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide the model's 2 KV heads"):
        check([f"model.path={tmp_path}", "parallel.tp=4"])
    _write_hf_config(tmp_path, "qwen3-untied", attention_bias=True)
    with pytest.raises(ConfigError, match=r"model.path: .*unsupported Qwen3ForCausalLM option: "
                                          r"attention_bias=true"):
        check([f"model.path={tmp_path}"])


def _write_moe_config(path, **changes):
    from tests.models.tiny_moe import build_tiny_moe_model

    config = build_tiny_moe_model("qwen3moe").config
    raw = {**config.to_dict(), "max_position_embeddings": 512, **changes}
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("overrides, world_size, message", [
    (["parallel.ep=3"], None, r"parallel.ep=3 does not divide the model's 8 experts; choose one "
                              r"of 1, 2, 4, 8"),
    (["parallel.ep=4"], 2, r"ep\*etp = 4\*1 does not divide the 2 ranks of a pipeline stage"),
    (["parallel.ep=2", "parallel.pp=2"], 2, r"ep\*etp = 2\*1 does not divide the 1 ranks"),
    (["parallel.etp=3"], None, r"parallel.etp=3 does not divide the model's expert FFN size 64"),
])
def test_expert_parallel_layouts_are_checked_against_the_experts_and_the_world(
        tmp_path, overrides, world_size, message):
    _write_moe_config(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        check([f"model.path={tmp_path}", *overrides], world_size=world_size)
    assert "\n" not in str(err.value)


def test_an_expert_parallel_layout_that_fits_is_accepted(tmp_path):
    _write_moe_config(tmp_path)
    check([f"model.path={tmp_path}", "parallel.ep=2"], world_size=2)
    check(["model.num_experts=4", "parallel.ep=2"], world_size=4)  # inline, EP2 x DP2
    check([f"model.path={tmp_path}", "parallel.tp=2", "parallel.ep=2"], world_size=4)  # TP2 x EP2


def test_expert_parallelism_on_a_dense_model_is_rejected():
    with pytest.raises(ConfigError, match=r"parallel.ep=2, parallel.etp=None: expert parallelism "
                                          r"needs a mixture-of-experts model"):
        check(["parallel.ep=2"])


def test_a_checkpoints_shape_is_the_callers_to_give():
    with pytest.raises(TypeError, match="needs the model's shape"):
        validate_config(load_config(None, ["model.path=/some/checkpoint"]))


def test_model_path_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        check([f"model.path={tmp_path}"])


def test_verify_every_below_one_is_rejected():
    with pytest.raises(ConfigError, match=r"reshard.verify_every must be >= 1, got 0"):
        check(["reshard.verify_every=0"])


@pytest.mark.parametrize("overrides, message", [
    (["rollout.min_new_tokens=-1"], r"rollout.min_new_tokens must be >= 0, got -1"),
    (["rollout.max_new_tokens=8", "rollout.min_new_tokens=9"],
     r"rollout.min_new_tokens=9 exceeds rollout.max_new_tokens=8"),
])
def test_min_new_tokens_outside_zero_to_max_is_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(overrides)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.advantage_estimator=gae"], r"dynamic_sampling filters prompt groups .*"
                                            r"advantage_estimator=gae: use grpo or rloo"),
    (["rollout.n_samples_per_prompt=1"], r"n_samples_per_prompt=1; set it to 2 or more"),
    (["algorithm.dynamic_sampling_max_rounds=-1"], r"dynamic_sampling_max_rounds must be >= 0, got -1"),
])
def test_dynamic_sampling_needs_groups_to_compare(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(["algorithm.dynamic_sampling=true"] + overrides)
    check(["algorithm.dynamic_sampling=true"])  # the defaults are fine


