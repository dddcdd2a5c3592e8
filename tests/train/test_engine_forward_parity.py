"""`TrainEngine.forward` log-probs equal HF transformers' on the converted model; padding and
micro-batch boundaries do not change them."""
import pytest
import torch

from tests.models.tiny_hf import build_tiny_hf_model, save_tiny_hf_model
from tests.world import shared_world

VARIANT = "qwen2-tied"  # QKV bias, tied embeddings, vocab 997 (padded)
LENGTHS = [7, 19, 3, 12, 16, 9]
TEMPERATURE = 0.7
TOL = 1e-4  # fp32 round-off between two implementations of the same model


def sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def hf_logprobs(hf_dir: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, unpadded: log p(token t | < t) for t >= 1 at TEMPERATURE."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logits = model(input_ids=ids).logits[0, :-1].float() / TEMPERATURE
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def _engine_logprobs(rank, world_size, hf_dir, tp, pp, budget, extra_pad):
    from mcore_rl.data.batch import Batch
    from mcore_rl.models import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(tp=tp, pp=pp)
    built = build_model(hf_dir, ctx, role="actor")
    engine = build_engine(built.chunks, ctx, vocab_size=built.spec.arch.vocab_size,
                          micro_batch_tokens=budget)
    seqs = sequences(built.spec.arch.vocab_size)
    batch = Batch.from_sequences(seqs, pad_id=0)
    if extra_pad:
        batch = batch.padded_to(len(batch), batch.num_tokens + extra_pad)
    out = engine.forward(batch, temperature=TEMPERATURE)["logprobs"]
    n_micro = len(engine._plan(batch))
    destroy_parallel()
    return out, n_micro


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / VARIANT
    save_tiny_hf_model(VARIANT, path)
    return str(path)


@pytest.mark.parametrize("tp, pp, budget, extra_pad", [
    (2, 1, 10_000, 0),   # one micro-batch
    (2, 1, 40, 5),       # several micro-batches, extra padding columns
    (1, 2, 40, 0),       # pipeline stages: results come from the last stage
])
def test_forward_logprobs_equal_hf_transformers(hf_dir, tp, pp, budget, extra_pad):
    expected = hf_logprobs(hf_dir, sequences(build_tiny_hf_model(VARIANT).config.vocab_size))
    (got, n_micro), _ = shared_world(2).run(_engine_logprobs, hf_dir, tp, pp, budget, extra_pad)
    if budget < 100:
        assert n_micro >= 3
    for i, exp in enumerate(expected):
        n = LENGTHS[i]
        assert got[i, 0] == 0  # nothing predicts the first token
        torch.testing.assert_close(got[i, 1:n], exp, atol=TOL, rtol=0)
        assert torch.all(got[i, n:] == 0), "padding positions must be zero"
