"""Engines by name, from the config; one clear line when an engine is not installed."""
import pytest

from mcore_rl.config.sections import RolloutConfig
from mcore_rl.engines import ENGINES, build_rollout_engine, sampling_from_config, sglang_shim, vllm_shim
from mcore_rl.engines.placement import plan_cpu_placement
from mcore_rl.errors import UsageError


def test_engines_are_registered_by_name():
    assert ENGINES.names() == ["hf", "hf_batched", "sglang", "vllm"]


@pytest.mark.parametrize("engine, shim, package", [("sglang", sglang_shim, "sglang"),
                                                   ("vllm", vllm_shim, "vllm")])
def test_choosing_an_engine_that_is_not_installed_says_what_to_install_in_one_line(
        monkeypatch, tmp_path, engine, shim, package):
    monkeypatch.setattr(shim, "available", lambda: False)
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    with pytest.raises(UsageError) as err:
        build_rollout_engine(RolloutConfig(engine=engine), tmp_path)
    message = str(err.value)
    assert "\n" not in message and f"pip install {package}" in message.replace("'", "")


def test_engine_settings_of_the_config_reach_only_their_engine(monkeypatch):
    seen = {}
    monkeypatch.setattr("mcore_rl.engines.hf_batched_engine.HFBatchedEngine",
                        lambda model_dir, **kw: seen.setdefault("hf_batched", kw))
    monkeypatch.setattr("mcore_rl.engines.vllm_engine.VLLMEngine",
                        lambda model_dir, **kw: seen.setdefault("vllm", kw))
    monkeypatch.setattr("mcore_rl.engines.hf_engine.HFEngine",
                        lambda model_dir, **kw: seen.setdefault("hf", kw))
    build_rollout_engine(RolloutConfig(engine="vllm", weight_loading="layerwise"), "/m")
    build_rollout_engine(RolloutConfig(engine="hf", weight_loading="layerwise"), "/m")
    assert seen["vllm"]["weight_loading"] == "layerwise" and "weight_loading" not in seen["hf"]
    assert seen["vllm"]["timeout_s"] == RolloutConfig().engine_timeout_s
    build_rollout_engine(RolloutConfig(engine="hf_batched", batch_rows=64), "/m")
    assert seen["hf_batched"]["max_batch_rows"] == 64 and "max_batch_rows" not in seen["hf"]


def test_an_unknown_engine_name_lists_the_engines():
    with pytest.raises(UsageError, match=r"unknown rollout engine 'trt' \(registered: hf, hf_batched, sglang, vllm"):
        build_rollout_engine(RolloutConfig(engine="trt"), "/nowhere")


def test_sampling_follows_the_rollout_config():
    cfg = RolloutConfig(n_samples_per_prompt=3, temperature=0.8, max_new_tokens=12)
    s = sampling_from_config(cfg, stop_token_ids=[2], seed=9)
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.stop_token_ids, s.seed) == \
        (3, 0.8, 1.0, -1, 12, (2,), 9)


def test_colocated_engines_share_all_cores_and_separate_ones_get_their_own():
    colocated = plan_cpu_placement("colocated", 2, cpus=[0, 1])
    assert colocated.omp_bind == "0|1" and colocated.trainer_cpus == (0, 1)
    assert plan_cpu_placement("colocated", 1, cpus=[0, 1]).omp_bind == "0-1"
    separate = plan_cpu_placement("separate", 1, cpus=[0, 1])
    assert separate.omp_bind == "0" and separate.trainer_cpus == (1,)
    wide = plan_cpu_placement("separate", 2, cpus=list(range(8)))
    assert wide.omp_bind == "0-1|2-3" and wide.trainer_cpus == (4, 5, 6, 7)
    with pytest.warns(UserWarning, match="sharing"):
        assert plan_cpu_placement("separate", 2, cpus=[0, 1]).trainer_cpus == (0, 1)
