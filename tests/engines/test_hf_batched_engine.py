"""`HFBatchedEngine`: one batch per call, checked against the one-prompt `HFEngine` and a
plain transformers forward over each finished sequence."""
import pytest
import torch

from mcore_rl.engines import ENGINES, SamplingConfig
from mcore_rl.engines.base import Request
from mcore_rl.engines.hf_batched_engine import HFBatchedEngine, prompt_chunks, truncate
from mcore_rl.engines.hf_engine import HFEngine
from mcore_rl.errors import UsageError
from tests.models.tiny_hf import load_hf, save_tiny_hf_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18]]
"""Different lengths, so that the batch is left-padded."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_hf_model("llama-tied", tmp_path_factory.mktemp("hf_batched"), seed=0))


@pytest.fixture(scope="module")
def batched(model_dir):
    return HFBatchedEngine(model_dir)


@pytest.fixture(scope="module")
def one_by_one(model_dir):
    return HFEngine(model_dir)


def _tokens(rollouts):
    return [(s.prompt_index, s.sample_index, s.token_ids) for s in rollouts]


def test_one_prompt_gives_exactly_the_hf_engines_samples(batched, one_by_one):
    for prompt in PROMPTS:
        sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=3)
        ours = batched.generate([prompt], sampling)
        theirs = one_by_one.generate([prompt], sampling)
        assert _tokens(ours) == _tokens(theirs)
        for a, b in zip(ours, theirs):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_padded_greedy_batch_matches_the_hf_engine_prompt_by_prompt(batched, one_by_one):
    greedy = SamplingConfig(n=1, temperature=0, max_new_tokens=6)
    assert _tokens(batched.generate(PROMPTS, greedy)) == _tokens(one_by_one.generate(PROMPTS, greedy))


def test_logprobs_are_those_of_a_plain_forward_over_each_sequence(batched, model_dir):
    model = load_hf(model_dir)
    rollouts = batched.generate(PROMPTS, SamplingConfig(n=3, temperature=0.7, max_new_tokens=5, seed=1))
    assert len(rollouts.samples) == 12
    for s in rollouts:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_token_ids + s.token_ids])).logits[0]
        expected = torch.log_softmax(logits[len(s.prompt_token_ids) - 1:-1] / 0.7, -1)
        expected = expected.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-5)


def test_rows_end_at_their_stop_token_and_their_prompt_leaves_when_all_rows_have(batched, one_by_one):
    stops = tuple(range(0, 256, 6))  # a sixth of the vocabulary: rows end at different steps
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=2, stop_token_ids=stops)
    rows = []
    hook = batched.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        stopped = batched.generate(PROMPTS, sampling)
    finally:
        hook.remove()
    assert rows[0] == 12 and min(rows) < 12  # a prompt left the batch when its rows had ended
    for s in stopped:
        ends = [t for t, tok in enumerate(s.token_ids) if tok in stops]
        assert ends == ([len(s.token_ids) - 1] if s.finish_reason == "stop" else [])
    assert {s.finish_reason for s in stopped} == {"stop", "length"}
    # each prompt alone, through the one-prompt engine: the same samples
    for i, prompt in enumerate(PROMPTS):
        alone = one_by_one.generate([prompt], sampling, seeds=[2 + i])
        assert [s.token_ids for s in alone] == [s.token_ids for s in stopped if s.prompt_index == i]


def test_min_new_tokens_holds_the_stop_token_back(batched):
    greedy = batched.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))
    stop = greedy.samples[0].token_ids[0]
    held = batched.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6, min_new_tokens=6,
                                                    stop_token_ids=(stop,)))
    assert all(len(s.token_ids) == 6 and stop not in s.token_ids for s in held)


def test_calls_larger_than_max_batch_rows_run_in_several_batches_with_the_same_samples(model_dir, batched):
    small = HFBatchedEngine(model_dir, max_batch_rows=4)
    sampling = SamplingConfig(n=2, temperature=0, max_new_tokens=4)
    assert _tokens(small.generate(PROMPTS, sampling)) == _tokens(batched.generate(PROMPTS, sampling))
    assert prompt_chunks(5, 2, 4) == [[0, 1], [2, 3], [4]]
    assert prompt_chunks(3, 8, 4) == [[0], [1], [2]]  # a prompt is never split


def test_step_runs_the_queued_requests_as_one_batch(model_dir, batched, monkeypatch):
    engine = HFBatchedEngine(model_dir)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4)
    for k, prompt in enumerate(PROMPTS):
        engine.submit(Request(f"r{k}", prompt, sampling, seed=10 + k))
    calls = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **kw: calls.append(a[0]) or generate(*a, **kw))
    finished = dict(engine.step())
    assert len(calls) == 1 and engine.step() == []
    expected = batched.generate(PROMPTS, sampling, seeds=[10, 11, 12, 13])
    for k in range(len(PROMPTS)):
        assert [(s.prompt_index, s.token_ids) for s in finished[f"r{k}"]] == \
            [(0, s.token_ids) for s in expected if s.prompt_index == k]


def test_truncate_keeps_the_top_k_then_the_top_p_mass():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(truncate(scores, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(truncate(scores, -1, 0.79)).tolist() == [[False, False, True, True]]
    assert torch.isinf(truncate(scores, -1, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(truncate(scores, -1, 0.3)).tolist() == [[False, True, True, True]]


def test_routes_are_refused_and_the_registry_says_so(batched):
    assert not ENGINES.entry("hf_batched").meta.get("returns_routes", False)
    with pytest.raises(UsageError, match="rollout.engine=hf"):
        batched.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=2, return_routes=True))
    with pytest.raises(UsageError, match="max_batch_rows"):
        HFBatchedEngine("never-read", max_batch_rows=0)
