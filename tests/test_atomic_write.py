"""Whole files or nothing: a failed write leaves the old file and no temporary behind."""
import json

import pytest

from mcore_rl.atomic_write import write_json_atomic, write_text_atomic


def test_a_write_replaces_the_file_whole(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    write_json_atomic(target, {"a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_json_atomic(target, {"not json": object()})
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(target, "\ud800")  # a lone surrogate: fails inside the write
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
