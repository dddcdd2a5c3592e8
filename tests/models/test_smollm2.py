"""The real SmolLM2-135M-Instruct (9 heads, 3 KV heads, tied embeddings), converted and run by
Megatron-Core at TP1 x PP2 and TP3: next-token log-probs on chat prompts match transformers.

Tolerance: fp32 on both sides, 30 layers. Only summation order may differ (Megatron's fused
QKV and gate/up GEMMs, TP partial sums). Measured on the CI CPU (max |log-prob - HF| over
the real tokens): 0 (bit-identical) at TP1 x PP2, 5.7e-5 at TP3. Bound: 1e-3, and the
same argmax at every position.
"""
import pytest
import torch

from mcore_rl.convert import convert_hf_to_mcore
from mcore_rl.models.smollm2 import prepare_smollm2_hf_dir
from tests.world import shared_world

ATOL_LOGPROB = 1e-3
PROMPTS = ["What is 12 + 7?", "Name a colour of the sky.", "Write one word that rhymes with cat."]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """HF directory, tokenized right-padded chat prompts, their mask and HF log-probs."""
    from transformers import AutoTokenizer

    from tests.models.tiny_hf import load_hf

    hf_dir = prepare_smollm2_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    length = max(len(r) for r in rows)
    toks = torch.full((len(rows), length), tokenizer.pad_token_id)
    mask = torch.zeros_like(toks)
    for i, row in enumerate(rows):
        toks[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    model = load_hf(hf_dir)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(toks, attention_mask=mask).logits.float(), -1)
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path_factory.mktemp("smollm2") / "mcore", tp=1, pp=2,
                               progress=False)
    return str(ckpt), toks, mask, logprobs


@pytest.fixture(scope="module")
def world2():
    return shared_world(2)


@pytest.fixture(scope="module")
def world3():
    return shared_world(3)


def _megatron_logprobs(rank, world_size, ckpt, toks, tp, pp):
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from tests.models.megatron_forward import forward_all_stages

    ctx = initialize_parallel(tp=tp, pp=pp)
    built = build_model(ckpt, ctx, role="actor")
    logits = forward_all_stages(ctx, built.chunks, toks)
    destroy_parallel()
    if logits is None:
        return None
    return torch.log_softmax(logits[..., : built.spec.arch.vocab_size].float(), -1)


def _check(results, mask, reference, layout):
    real = mask.bool()
    for logprobs in results:
        diff = (logprobs - reference).abs()[real].max().item()
        print(f"SmolLM2 {layout}: max |log-prob - HF| over {int(real.sum())} positions: {diff:.2e}")
        assert diff <= ATOL_LOGPROB
        assert torch.equal(logprobs.argmax(-1)[real], reference.argmax(-1)[real])


def test_smollm2_next_token_logprobs_match_transformers_at_tp1xpp2(world2, smollm2):
    ckpt, toks, mask, reference = smollm2
    results = [r for r in world2.run(_megatron_logprobs, ckpt, toks, 1, 2) if r is not None]
    assert len(results) == 1  # the last stage
    _check(results, mask, reference, "TP1xPP2")


def test_smollm2_next_token_logprobs_match_transformers_at_tp3(world3, smollm2):
    ckpt, toks, mask, reference = smollm2
    results = world3.run(_megatron_logprobs, ckpt, toks, 3, 1)
    assert len(results) == 3  # every TP rank gathers the full vocabulary
    _check(results, mask, reference, "TP3")
