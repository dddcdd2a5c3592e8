"""Pure tensor functions: QKV and gate/up (un)fusion, TP chunks, padded vocab, pooling, files."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.models.arch import ModelArch
from mcore_rl.models.mapping import (fuse_gate_up, fuse_qkv, split_gate_up, split_qkv,
                                     tensor_mappings, tp_chunks)
from mcore_rl.models.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter
from mcore_rl.models.vocab import mask_padded_vocab
from mcore_rl.models.value_head import sequence_scores

ARCH = ModelArch(vocab_size=250, hidden_size=8, intermediate_size=12, num_layers=2,
                 num_attention_heads=6, num_kv_heads=2, head_dim=2)


def _labelled(prefix: int, rows: int) -> torch.Tensor:
    """Rows whose first column says where they came from (prefix * 100 + row)."""
    out = torch.zeros(rows, 3)
    out[:, 0] = prefix * 100 + torch.arange(rows)
    return out


def test_qkv_is_fused_per_query_group_q_then_k_then_v():
    d, q_per_group = 2, 3
    q, k, v = _labelled(1, 6 * d), _labelled(2, 2 * d), _labelled(3, 2 * d)
    fused = fuse_qkv(q, k, v, num_kv_heads=2)[:, 0].tolist()
    group0 = list(range(100, 100 + q_per_group * d)) + [200, 201, 300, 301]
    group1 = list(range(106, 106 + q_per_group * d)) + [202, 203, 302, 303]
    assert fused == group0 + group1
    unfused = split_qkv(fuse_qkv(q, k, v, 2), 6, 2, d)
    assert all(torch.equal(a, b) for a, b in zip(unfused, (q, k, v)))


def test_a_tp_shard_of_qkv_unfuses_with_local_head_counts():
    q, k, v = _labelled(1, 12), _labelled(2, 4), _labelled(3, 4)
    shard1 = fuse_qkv(q, k, v, num_kv_heads=2).chunk(2)[1]  # TP rank 1 of 2: query group 1
    lq, lk, lv = split_qkv(shard1, num_heads=3, num_kv_heads=1, head_dim=2)
    assert torch.equal(lq, q[6:]) and torch.equal(lk, k[2:]) and torch.equal(lv, v[2:])


def test_qkv_bias_fuses_like_the_weight():
    q, k, v = torch.arange(12.0), torch.arange(100.0, 104), torch.arange(200.0, 204)
    fused = fuse_qkv(q, k, v, num_kv_heads=2)
    assert fused.tolist()[:10] == [0, 1, 2, 3, 4, 5, 100, 101, 200, 201]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 6, 2, 2), (q, k, v)))


def test_gate_up_is_gate_then_up_and_tp_chunks_take_each_ranks_rows_of_both():
    gate, up = _labelled(1, 12), _labelled(2, 12)
    assert torch.equal(torch.cat(split_gate_up(fuse_gate_up(gate, up))), torch.cat([gate, up]))
    fc1 = next(m for m in tensor_mappings(ARCH, "lm") if m.mcore_key.endswith("linear_fc1.weight"))
    chunks = tp_chunks(fc1, ARCH, tp=2)
    assert chunks == [((0, 0), (6, 8)), ((12, 0), (6, 8)), ((6, 0), (6, 8)), ((18, 0), (6, 8))]


def test_tied_models_have_no_output_layer_and_score_heads_map_to_score():
    tied = ModelArch(**{**ARCH.to_dict(), "tie_word_embeddings": True})
    assert "output_layer.weight" not in {m.mcore_key for m in tensor_mappings(tied, "lm")}
    score = {m.mcore_key: m for m in tensor_mappings(tied, "score")}["output_layer.weight"]
    assert score.hf_names == ("score.weight",) and score.tp_axis is None


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_masked_vocab_shards_give_the_log_probs_of_the_real_vocabulary(tp):
    vocab, padded = 250, 256
    logits = torch.randn(3, padded)
    logits[:, vocab:] = 0.0  # what zero padded rows produce
    shards = [mask_padded_vocab(shard.clone(), vocab, rank, tp)
              for rank, shard in enumerate(logits.chunk(tp, -1))]
    masked = torch.cat(shards, -1)
    assert torch.isinf(masked[:, vocab:]).all() and torch.isfinite(masked[:, :vocab]).all()
    expected = torch.log_softmax(logits[:, :vocab], -1)
    assert torch.allclose(torch.log_softmax(masked, -1)[:, :vocab], expected, atol=1e-6)


def test_sequence_scores_pool_the_last_non_padding_token_like_hf():
    values = torch.arange(12.0).reshape(2, 6)
    right = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    assert sequence_scores(values, right).tolist() == [2.0, 11.0]
    assert sequence_scores(values, left).tolist() == [5.0, 11.0]


def test_streamed_safetensors_are_read_by_the_safetensors_library_and_back(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, 2, 2)}
    with SafetensorsWriter(tmp_path / "model.safetensors",
                           [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    save_file(tensors, tmp_path / "lib.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "lib.safetensors" for n in tensors}}))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert all(torch.equal(ckpt.read(n), t) for n, t in tensors.items())
