"""vLLM's sampling masks (``return_sampling_mask``, Model Runner V2 on GPUs) as kept sets the
trainer replays: refused in one line on CPU, and on a GPU with vLLM the reported sets are
the truncation of HF's logits and give the engine's own log-probs back."""
import pytest
import torch

from mcore_rl.engines import SamplingConfig
from tests.models.tiny_hf import load_hf, save_tiny_hf_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def test_on_cpu_the_engine_refuses_sampling_masks_before_it_starts(tmp_path):
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from mcore_rl.engines.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="return_sampling_mask needs vLLM on a GPU"):
        VLLMEngine(tmp_path, return_sampling_mask=True)


@pytest.mark.gpu
def test_reported_kept_sets_are_the_truncation_and_replay_the_engines_logprobs(tmp_path):
    pytest.importorskip("vllm")
    from mcore_rl.engines.vllm_engine import VLLMEngine
    from mcore_rl.kernels import token_logprobs
    from mcore_rl.kernels.token_logprobs.reference import truncate_reference

    model_dir = str(save_tiny_hf_model("qwen2-tied", tmp_path / "model", seed=0))
    engine = VLLMEngine(model_dir, tp=1, max_model_len=128, return_sampling_mask=True)
    try:
        rollouts = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=0.8, max_new_tokens=6, seed=1,
                                                           top_k=20, top_p=0.9, return_kept_ids=True))
    finally:
        engine.close()
    model = load_hf(model_dir)
    for s in rollouts:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_token_ids + s.token_ids])).logits[0, len(s.prompt_token_ids) - 1:-1]
        expected = torch.isfinite(truncate_reference(logits.float() / 0.8, 20, 0.9))
        assert [sorted(ids) for ids in s.kept_ids] == [row.nonzero()[:, 0].tolist() for row in expected]
        width = max(len(ids) for ids in s.kept_ids)
        kept_ids = torch.tensor([ids + [-1] * (width - len(ids)) for ids in s.kept_ids])
        replayed = token_logprobs(logits.float(), torch.tensor(s.token_ids), temperature=0.8, kept_ids=kept_ids)
        assert torch.allclose(replayed, torch.tensor(s.logprobs), atol=1e-4)
