"""The shared batch type: construction, selection, padding, concatenation."""
import pytest
import torch

from mcore_rl.data.batch import Batch


def test_from_sequences_right_pads_and_marks_response_tokens():
    b = Batch.from_sequences([[5, 6, 7], [8, 9]], prompt_lens=[1, 1], pad_id=0, uid=["a", "b"])
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["response_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert b.seq_lens.tolist() == [3, 2] and len(b) == 2


def test_select_keeps_tensors_and_metadata_aligned():
    b = Batch.from_sequences([[1], [2, 2], [3, 3, 3]], uid=["a", "b", "c"])
    s = b.select([2, 0])
    assert s.meta["uid"] == ["c", "a"]
    assert s["input_ids"][:, 0].tolist() == [3, 1]


def test_trimmed_drops_only_all_padding_columns():
    b = Batch.from_sequences([[1, 2, 3, 4], [1]]).select([1])
    assert b.num_tokens == 4 and b.trimmed().num_tokens == 1


def test_padded_to_adds_rows_and_columns_that_are_masked_out():
    b = Batch.from_sequences([[1, 2]], prompt_lens=[1], uid=["a"]).padded_to(3, 4)
    assert b["input_ids"].shape == (3, 4)
    assert b["attention_mask"].sum() == 2 and b["response_mask"].sum() == 1
    assert b.meta["uid"] == ["a", None, None]


def test_cat_pads_to_the_longest_sequence():
    a = Batch.from_sequences([[1, 2, 3]])
    b = Batch.from_sequences([[4]])
    c = Batch.cat([a, b])
    assert c["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]


def test_per_token_fields_with_trailing_dimensions_pad_along_the_tokens():
    a = Batch.from_sequences([[1, 2, 3]])
    a = a.with_tensors(routes=torch.arange(1, 13).reshape(1, 3, 2, 2))  # [B, T, layers, k]
    b = Batch.from_sequences([[4]]).with_tensors(routes=torch.full((1, 1, 2, 2), 7))
    c = Batch.cat([b, a])
    assert c["routes"].shape == (2, 3, 2, 2)
    assert c["routes"][0, 1:].eq(0).all() and c["routes"][1].equal(a["routes"][0])
    padded = b.padded_to(2, 3)["routes"]
    assert padded.shape == (2, 3, 2, 2) and padded[0, 0].eq(7).all() and padded.sum() == 7 * 4


def test_fields_with_different_sequence_counts_are_rejected():
    with pytest.raises(ValueError, match="disagree on the number of sequences"):
        Batch({"input_ids": torch.zeros(2, 3), "x": torch.zeros(3)})


def test_to_moves_every_tensor_and_keeps_metadata():
    b = Batch.from_sequences([[1, 2], [3]], uid=["a", "b"])
    b.info["step"] = 3
    assert b.to("cpu") is b  # already there: no copy
    moved = b.to("meta")
    assert {v.device.type for v in moved.tensors.values()} == {"meta"}
    assert moved.tensors.keys() == b.tensors.keys() and moved["input_ids"].shape == (2, 2)
    assert moved.meta == {"uid": ["a", "b"]} and moved.info == {"step": 3}
    assert b["input_ids"].device.type == "cpu"  # the original stays
