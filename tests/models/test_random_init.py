"""The random initial model of a run without ``model.path`` comes from the machine's cache
(`mcore_rl.models.random_init.copy_random_model`): the same bytes as writing it, written into
the cache once per architecture, token ids, seed and code that draws it, and written directly
where the cache cannot be."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.data.toy_task import toy_tokenizer
from mcore_rl.models import random_init
from mcore_rl.models.cache import COMPLETE, made_once

REPO = Path(__file__).resolve().parents[2]
TOK = toy_tokenizer()
IDS = (TOK.vocab_size, TOK.bos_id, TOK.eos_id, TOK.pad_id)


@pytest.fixture()
def arch():
    return load_config(REPO / "configs" / "quickstart.yaml").model


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_copy_from_the_cache_holds_the_bytes_of_a_fresh_write(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("MCORE_RL_CACHE", str(tmp_path / "cache"))
    fresh = random_init.write_random_model(arch, tmp_path / "fresh", *IDS, seed=3)
    first = random_init.copy_random_model(arch, tmp_path / "first", *IDS, seed=3)
    again = random_init.copy_random_model(arch, tmp_path / "again", *IDS, seed=3)
    assert set(files(fresh)) == {"config.json", "generation_config.json", "model.safetensors"}
    assert files(first) == files(fresh) and files(again) == files(fresh)


def test_the_model_is_written_once_per_seed_architecture_and_code(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("MCORE_RL_CACHE", str(tmp_path / "cache"))
    random_init.copy_random_model(arch, tmp_path / "before", *IDS, seed=3)
    written = []
    write = random_init.write_random_model

    def counting(model, out, *args, **kwargs):
        written.append((model.num_layers, kwargs["seed"] if "seed" in kwargs else args[-1]))
        return write(model, out, *args, **kwargs)

    monkeypatch.setattr(random_init, "write_random_model", counting)
    for i, seed in enumerate([3, 3, 4, 3]):
        random_init.copy_random_model(arch, tmp_path / f"run{i}", *IDS, seed=seed)
    deeper = replace(arch, num_layers=arch.num_layers + 1)
    random_init.copy_random_model(deeper, tmp_path / "deeper", *IDS, seed=3)
    # other code (the counting wrapper) draws seed 3 again, then each new seed or shape once
    assert written == [(arch.num_layers, 3), (arch.num_layers, 4), (arch.num_layers + 1, 3)]
    assert len(list((tmp_path / "cache" / "random-models").iterdir())) == 4
    assert files(tmp_path / "run0") == files(tmp_path / "run3") != files(tmp_path / "run2")


def test_a_cache_that_cannot_be_written_is_passed_by(arch, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("MCORE_RL_CACHE", str(blocked))
    out = random_init.copy_random_model(arch, tmp_path / "run", *IDS, seed=3)
    fresh = random_init.write_random_model(arch, tmp_path / "fresh", *IDS, seed=3)
    assert files(out) == files(fresh)


def test_an_incomplete_copy_is_made_again_and_a_complete_one_reused(tmp_path):
    out = tmp_path / "entry"
    out.mkdir()
    (out / "half").write_text("left by a writer that was killed")
    made_once(out, lambda d: (d / "whole").write_text("1"))
    assert sorted(p.name for p in out.iterdir()) == [COMPLETE, "whole"]
    made_once(out, lambda d: pytest.fail("a complete copy is made again"))
    assert not [p for p in tmp_path.iterdir() if p.name != "entry"]  # no partial directory left
