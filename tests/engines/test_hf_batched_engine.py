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


@pytest.mark.parametrize("options", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, top_k=20, top_p=0.8, min_new_tokens=2, stop_token_ids=tuple(range(0, 256, 7))),
    dict(temperature=0, min_new_tokens=3, stop_token_ids=tuple(range(0, 256, 5))),
], ids=["t1", "t0.7-topk", "t1.3-topp", "topk-topp-stops-min", "greedy-stops-min"])
def test_one_prompt_gives_exactly_the_hf_engines_samples(batched, one_by_one, options):
    for prompt in PROMPTS:
        sampling = SamplingConfig(n=4, max_new_tokens=6, seed=3, **options)
        ours = batched.generate([prompt], sampling)
        theirs = one_by_one.generate([prompt], sampling)
        assert _tokens(ours) == _tokens(theirs)
        assert [s.finish_reason for s in ours] == [s.finish_reason for s in theirs]
        # The same log-probs up to fp32 round-off from batch shape: the batched engine runs the
        # prompt's n rows through its own left-padded, last-position forward; the one-prompt
        # engine runs transformers' generate (one row when greedy). Other kernel shapes sum in
        # another order (on AVX2 CPUs ~2e-6 apart); a real difference is orders of magnitude larger.
        for a, b in zip(ours, theirs):
            assert a.logprobs == pytest.approx(b.logprobs, rel=1e-5, abs=1e-5), (a.prompt_index, a.sample_index)


def test_padded_greedy_batch_matches_the_hf_engine_prompt_by_prompt(batched, one_by_one):
    greedy = SamplingConfig(n=2, temperature=0, max_new_tokens=6)
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


@pytest.mark.parametrize("truncation", [dict(top_p=0.8), dict(top_k=20)], ids=["top_p", "top_k"])
def test_truncated_sampling_logprobs_are_the_trainers_truncated_ones(batched, one_by_one, model_dir, truncation):
    from mcore_rl.kernels import token_logprobs

    model = load_hf(model_dir)
    sampling = SamplingConfig(n=3, temperature=0.7, max_new_tokens=5, seed=1, **truncation)
    for engine in (batched, one_by_one):
        for s in engine.generate(PROMPTS, sampling):
            with torch.no_grad():
                logits = model(torch.tensor([s.prompt_token_ids + s.token_ids])).logits[0]
            expected, kept = token_logprobs(logits[len(s.prompt_token_ids) - 1:-1], torch.tensor(s.token_ids),
                                            temperature=0.7, return_kept=True, **truncation)
            assert bool(kept.all())
            assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-5), type(engine).__name__


def test_reported_kept_sets_are_the_truncations_and_land_on_their_tokens_in_the_batch(batched, model_dir):
    from mcore_rl.kernels.token_logprobs.reference import truncate_reference

    model = load_hf(model_dir)
    rollouts = batched.generate(PROMPTS, SamplingConfig(n=2, temperature=0.7, max_new_tokens=4, seed=2, top_k=8,
                                                        top_p=0.9, return_kept_ids=True))
    for s in rollouts:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_token_ids + s.token_ids])).logits[0]
        expected = torch.isfinite(truncate_reference(logits[len(s.prompt_token_ids) - 1:-1] / 0.7, 8, 0.9))
        assert [sorted(ids) for ids in s.kept_ids] == [row.nonzero()[:, 0].tolist() for row in expected]
        assert all(tok in ids for tok, ids in zip(s.token_ids, s.kept_ids))
    batch = rollouts.to_batch()
    s = rollouts.samples[3]
    p = len(s.prompt_token_ids)
    for t, ids in enumerate(s.kept_ids):
        row = batch["kept_ids"][3, p + t]
        assert sorted((row[row > 0] - 1).tolist()) == sorted(ids)
    assert int(batch["kept_ids"][3, :p].abs().sum()) == 0, "prompt tokens carry no kept set"


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


def test_min_new_tokens_holds_the_stop_tokens_back_until_that_length(batched):
    stops = tuple(range(0, 300, 2))  # half the vocabulary, and ids past its end
    held = batched.generate(PROMPTS, SamplingConfig(n=4, max_new_tokens=6, min_new_tokens=3,
                                                    stop_token_ids=stops, seed=0))
    # three tokens that are no stop token, then a stop may come (at half the vocabulary, soon)
    assert all(len(s.token_ids) > 3 and not set(s.token_ids[:3]) & set(stops) for s in held)
    assert min(len(s.token_ids) for s in held if s.finish_reason == "stop") == 4


def test_calls_larger_than_max_batch_rows_run_in_several_batches_with_the_same_samples(model_dir, batched):
    small = HFBatchedEngine(model_dir, max_batch_rows=4)
    sampling = SamplingConfig(n=2, temperature=0, max_new_tokens=4)
    assert _tokens(small.generate(PROMPTS, sampling)) == _tokens(batched.generate(PROMPTS, sampling))
    assert prompt_chunks(5, 2, 4) == [[0, 1], [2, 3], [4]]
    assert prompt_chunks(3, 8, 4) == [[0], [1], [2]]  # a prompt is never split


def test_step_batches_requests_that_sample_alike_and_keeps_the_queue_when_it_fails(model_dir, one_by_one):
    engine = HFBatchedEngine(model_dir)
    greedy, sampled = SamplingConfig(temperature=0, max_new_tokens=3), SamplingConfig(n=2, max_new_tokens=3)
    for rid, prompt, sampling, seed in [("a", PROMPTS[0], sampled, None), ("b", PROMPTS[1], greedy, 1),
                                        ("c", PROMPTS[2], sampled, 7)]:
        engine.submit(Request(rid, prompt, sampling, seed))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake()
    first = dict(engine.step())
    assert set(first) == {"a", "c"} and set(dict(engine.step())) == {"b"} and engine.step() == []
    # a request without a seed samples as it would alone
    assert [s.token_ids for s in first["a"]] == [s.token_ids for s in one_by_one.generate([PROMPTS[0]], sampled)]
    assert [s.token_ids for s in first["c"]] == \
        [s.token_ids for s in one_by_one.generate([PROMPTS[2]], sampled, seeds=[7])]


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


def test_each_forward_returns_the_logits_of_the_last_position_only(batched):
    widths = []
    hook = batched.model.register_forward_hook(lambda module, args, out: widths.append(out.logits.shape[1]))
    try:
        batched.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=3, seed=0))
    finally:
        hook.remove()
    assert widths == [1, 1, 1]  # the prefill ([rows, 6 positions]) too: not [rows, 6, vocab]
