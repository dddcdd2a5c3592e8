"""`train.job: rm` trains the score at the token HF's ``*ForSequenceClassification`` reads it:
with pad equal to EOS (SmolLM2), the token before a trailing EOS."""
import pytest
import torch

from mcore_rl.data.finetune_records import Pair
from mcore_rl.finetune.rm import RewardModelJob
from tests.models.tiny_hf import build_tiny_hf_model

EOS = 2


@pytest.mark.parametrize("pad_id", [EOS, 0])
def test_each_side_ends_where_hf_pools(pad_id):
    model = build_tiny_hf_model("llama-tied", head="score", seed=1)
    model.config.pad_token_id = pad_id
    pairs = [Pair([1, 5, 6], [7, 8, EOS], [9, EOS]), Pair([1, 4], [3, 3, 3, EOS], [10, 11])]
    batch = RewardModelJob.__new__(RewardModelJob).batch(pairs, pad_id)
    full = [p.prompt_ids + side for p in pairs for side in (p.chosen_ids, p.rejected_ids)]
    with torch.no_grad():
        for row, ids in enumerate(full):
            hf = model(torch.tensor([ids])).logits[0, 0]  # HF's own pooling of the whole text
            n = int(batch["attention_mask"][row].sum())  # the job's last real token: n - 1
            kept = batch["input_ids"][row, :n].tolist()
            assert kept == ids[:n]
            ours = model.model(torch.tensor([kept])).last_hidden_state[0, -1] @ model.score.weight[0]
            assert torch.allclose(ours, hf, atol=1e-5), (pad_id, ids, kept)
            assert (n == len(ids) - 1) == (pad_id == EOS and ids[-1] == EOS)
