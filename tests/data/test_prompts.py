"""Prompt sources: files with configurable fields, reasoning-gym, the toy task, seeded order."""
import json

import pytest

from mcore_rl.config import DataConfig
from mcore_rl.data.prompts import PromptRecord, PromptStream, load_prompt_records, read_records
from mcore_rl.data.tokenizer import CharTokenizer
from mcore_rl.errors import UsageError


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_jsonl_fields_are_configurable_and_reach_the_reward_metadata(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1?", "a": "2", "level": 1}])
    (rec,) = read_records(path, "q", "a")
    assert rec.prompt == "1+1?" and rec.meta == {"a": "2", "level": 1, "answer": "2"}


def test_missing_field_names_file_row_and_config_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "a": "1"}, {"question": "y", "a": "2"}])
    with pytest.raises(UsageError, match=r"row 2 has no field 'q' \(data.prompt_key\); fields "
                                         r"there: a, question"):
        read_records(path, "q", "a")


def test_parquet_records_load_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "answer": 3}]), tmp_path / "d.parquet")
    cfg = DataConfig(source="parquet", path=str(tmp_path / "d.parquet"), num_val=0)
    (rec,) = load_prompt_records(cfg, "train")
    assert rec.meta["answer"] == 3


def test_reasoning_gym_source_is_seeded_and_carries_the_entry():
    cfg = DataConfig(source="reasoning_gym", task="basic_arithmetic", num_val=4, seed=1)
    a, b = load_prompt_records(cfg, "val"), load_prompt_records(cfg, "val")
    assert [r.prompt for r in a] == [r.prompt for r in b] and len(a) == 4
    assert a[0].meta["task"] == "basic_arithmetic" and "entry" in a[0].meta


def test_prompt_stream_is_reproducible_from_its_position():
    records = load_prompt_records(DataConfig(source="builtin"), "train")
    s1 = PromptStream(records, seed=5)
    first = s1.take(150)  # crosses an epoch boundary
    s2 = PromptStream(records, seed=5)
    s2.position = 120
    assert [r.prompt for r in s2.take(30)] == [r.prompt for r in first[120:]]
    assert sorted(r.prompt for r in first[:100]) == sorted(r.prompt for r in records)


def test_every_prompt_taken_carries_its_epoch_and_dataset_index_also_after_a_resume():
    records = [PromptRecord(f"p{i}", {"answer": i}) for i in range(7)]
    stream = PromptStream(records, seed=2)
    taken = stream.take(16)  # two epochs and two prompts of the third
    for r in taken:  # the identity names the record it came from
        assert r.prompt == records[r.meta["data_index"]].prompt
        assert r.meta["answer"] == r.meta["data_index"]
    assert [r.meta["data_epoch"] for r in taken] == [0] * 7 + [1] * 7 + [2] * 2
    for epoch in (0, 1):  # each epoch: every index once
        assert sorted(r.meta["data_index"] for r in taken if r.meta["data_epoch"] == epoch) == \
            list(range(7))
    assert "data_index" not in records[0].meta  # the dataset's records stay as they were
    resumed = PromptStream(records, seed=2)
    resumed.position = 9
    assert [(r.meta["data_epoch"], r.meta["data_index"]) for r in resumed.take(7)] == \
        [(r.meta["data_epoch"], r.meta["data_index"]) for r in taken[9:]]


def test_char_tokenizer_round_trips_and_rejects_unknown_characters(tmp_path):
    tok = CharTokenizer("0123456789+=")
    assert tok.decode(tok.encode("3+4=7")) == "3+4=7"
    tok.save(tmp_path)
    assert CharTokenizer.load(tmp_path).encode("12") == tok.encode("12")
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        tok.encode("x")


def test_a_prompt_stream_shuffles_once_per_epoch_in_the_seeded_order(monkeypatch):
    import random

    records = [PromptRecord(str(i), {}) for i in range(5000)]
    shuffles = []
    shuffle = random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: shuffles.append(1) or shuffle(self, x))
    stream = PromptStream(records, seed=3)
    taken = [int(r.prompt) for r in stream.take(5200)]  # the first epoch and part of the second
    assert len(shuffles) == 2  # not once per record taken (5,200 shuffles of 5,000 records)
    expected = []
    for epoch in (0, 1):
        order = list(range(5000))
        random.Random(3 * 1_000_003 + epoch).shuffle(order)
        expected += order
    assert taken == expected[:5200]
    stream.position = 10  # moved back (a resume): the first epoch's order again
    assert [int(r.prompt) for r in stream.take(3)] == expected[10:13]
