"""`HFEngine`, the transformers fallback: same interface and conventions as vLLM's engine."""
import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.engines import SamplingConfig
from mcore_rl.engines.hf_engine import HFEngine
from mcore_rl.errors import UsageError
from tests.models.tiny_hf import load_hf, save_tiny_hf_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_engine")
    return [str(save_tiny_hf_model("llama-tied", root / f"s{s}", seed=s)) for s in (0, 1)]


@pytest.fixture
def engine(dirs):
    return HFEngine(dirs[0])


def test_samples_are_reproducible_per_request_seed(engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=5, seed=4)
    first = [s.token_ids for s in engine.generate(PROMPTS, sampling)]
    assert first == [s.token_ids for s in engine.generate(PROMPTS, sampling)]
    other = SamplingConfig(n=2, temperature=1.0, max_new_tokens=5, seed=5)
    assert first != [s.token_ids for s in engine.generate(PROMPTS, other)]


def test_logprobs_follow_the_convention_log_softmax_of_logits_over_temperature(engine, dirs):
    model = load_hf(dirs[0])
    for s in engine.generate(PROMPTS, SamplingConfig(n=2, temperature=0.6, max_new_tokens=5, seed=1)):
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_token_ids + s.token_ids])).logits[0]
        expected = torch.log_softmax(logits[len(s.prompt_token_ids) - 1:-1] / 0.6, -1)
        expected = expected.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-5)


def test_a_stop_token_is_kept_as_the_last_token(engine):
    greedy = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=6))[0]
    stop = greedy.token_ids[1]
    stopped = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=6,
                                                          stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == greedy.token_ids[:greedy.token_ids.index(stop) + 1]
    assert (stopped.finish_reason, greedy.finish_reason) == ("stop", "length")


def test_update_weights_makes_it_generate_what_the_new_weights_generate(engine, dirs):
    engine.update_weights(load_file(f"{dirs[1]}/model.safetensors").items(), version=2, bucket_mb=0.02)
    fresh = HFEngine(dirs[1])
    greedy = SamplingConfig(temperature=0, max_new_tokens=6)
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy)] == \
        [s.token_ids for s in fresh.generate(PROMPTS, greedy)]
    assert engine.weight_version == 2


def test_the_hf_engine_refuses_tensor_parallelism(dirs):
    with pytest.raises(UsageError, match="engine_tp=1"):
        HFEngine(dirs[0], tp=2)


def test_min_new_tokens_masks_the_stop_token_until_that_length(engine):
    greedy = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8))[0]
    stop = greedy.token_ids[1]
    held = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8, min_new_tokens=8,
                                                       stop_token_ids=(stop,)))[0]
    assert len(held.token_ids) == 8 and held.finish_reason == "length"
    first = greedy.token_ids.index(stop)
    assert stop not in held.token_ids and held.token_ids[:first] == greedy.token_ids[:first]


@pytest.mark.parametrize("variant", ["qwen3moe", "mixtral"])
def test_per_expert_checkpoint_tensors_load_into_the_fused_expert_weights(tmp_path, variant):
    from tests.models.tiny_moe import save_tiny_moe_model

    start = save_tiny_moe_model(variant, tmp_path / "start", seed=0)
    new = save_tiny_moe_model(variant, tmp_path / "new", seed=1)
    engine = HFEngine(start)
    tensors = load_file(f"{new}/model.safetensors")
    assert any(".experts.7." in name for name in tensors), "checkpoints name experts one by one"
    engine.update_weights(tensors.items(), version=1, bucket_mb=0.05)
    expected = load_hf(new).state_dict()
    got = engine.model.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert engine.weight_version == 1


def test_sampling_defaults_of_the_checkpoint_do_not_apply(tmp_path, dirs):
    import shutil

    from transformers import GenerationConfig

    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=1)
    plain = [s.token_ids for s in HFEngine(dirs[0]).generate(PROMPTS, sampling)]
    biased = tmp_path / "biased"
    shutil.copytree(dirs[0], biased)
    # defaults that generate() would apply: every token the plain model sampled suppressed
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, repetition_penalty=3.0,
                     suppress_tokens=sorted({t for tokens in plain for t in tokens})).save_pretrained(biased)
    assert [s.token_ids for s in HFEngine(biased).generate(PROMPTS, sampling)] == plain


def test_greedy_gives_n_copies_of_the_one_greedy_response(engine):
    one = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=5))
    three = engine.generate(PROMPTS, SamplingConfig(n=3, temperature=0, max_new_tokens=5))
    assert [(s.prompt_index, s.sample_index) for s in three] == [(i, j) for i in range(2) for j in range(3)]
    assert [(s.token_ids, s.logprobs) for s in three] == [(s.token_ids, s.logprobs) for s in one for _ in range(3)]
