"""Bad input to ``mcore-rl convert``: one clear line, a non-zero exit, no partial output."""
import json
import subprocess
import sys

import pytest

from mcore_rl.cli.main import main
from mcore_rl.convert import convert_hf_to_mcore
from tests.models.tiny_hf import save_tiny_hf_model


@pytest.fixture
def hf_dir(tmp_path):
    return save_tiny_hf_model("llama-untied", tmp_path / "hf")


def _convert(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # drop what fixtures printed
    code = main(["convert", *argv, "--quiet"])
    return code, capsys.readouterr().err


def _assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mcore-rl convert: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _assert_nothing_written(out) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _hf_to_mcore(capsys, hf_dir, out, *extra):
    return _convert(capsys, "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(out), *extra)


def test_missing_safetensors_file_is_reported(capsys, hf_dir, tmp_path):
    (hf_dir / "model.safetensors").unlink()
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out")
    _assert_one_line_error(code, err, "no safetensors weights")
    _assert_nothing_written(tmp_path / "out")


def test_shard_listed_in_index_but_missing_is_reported(capsys, hf_dir, tmp_path):
    (hf_dir / "model.safetensors").rename(hf_dir / "model-00001-of-00002.safetensors")
    index = {"metadata": {},
             "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out")
    _assert_one_line_error(code, err, "missing", "model-00002-of-00002.safetensors")
    _assert_nothing_written(tmp_path / "out")


def test_truncated_safetensors_is_reported(capsys, hf_dir, tmp_path):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out")
    _assert_one_line_error(code, err, "truncated")
    _assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("field,value,fragment", [
    ("num_hidden_layers", 1, "model.layers.1"),
    ("intermediate_size", 512,
     "gate_proj.weight has shape [256, 128], the config implies [512, 128]"),
    ("vocab_size", 1000, "embed_tokens.weight has shape [1003, 128]"),
])
def test_config_that_does_not_match_the_weights_is_reported(capsys, hf_dir, tmp_path, field,
                                                             value, fragment):
    config = json.loads((hf_dir / "config.json").read_text())
    config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out")
    _assert_one_line_error(code, err, "config.json does not match the weights", fragment)
    _assert_nothing_written(tmp_path / "out")


def test_tp_that_does_not_divide_the_heads_is_reported(capsys, hf_dir, tmp_path):
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out", "--tp", "3")
    _assert_one_line_error(code, err, "TP 3 does not divide num_attention_heads 4")
    _assert_nothing_written(tmp_path / "out")


def test_pp_that_does_not_divide_the_layers_is_reported(capsys, hf_dir, tmp_path):
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out", "--pp", "4")
    _assert_one_line_error(code, err, "PP 4 does not divide num_hidden_layers 2")


def test_non_empty_output_directory_is_refused_unless_force(capsys, hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, err = _hf_to_mcore(capsys, hf_dir, out)
    _assert_one_line_error(code, err, "exists and is not empty", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    code, _ = _hf_to_mcore(capsys, hf_dir, out, "--force")
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["hf", "mcore_rl.json", "model"]


def test_failure_while_writing_leaves_no_partial_output(hf_dir, tmp_path, monkeypatch):
    from mcore_rl.models.hf_weights import HFWeightSource

    calls = []
    original = HFWeightSource.read

    def read_then_fail(self, *args):
        calls.append(1)
        if len(calls) > 5:
            raise OSError("disk full")
        return original(self, *args)

    monkeypatch.setattr(HFWeightSource, "read", read_then_fail)
    with pytest.raises(OSError, match="disk full"):
        convert_hf_to_mcore(hf_dir, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_mcore_to_hf_of_a_directory_that_is_no_checkpoint_is_reported(capsys, hf_dir, tmp_path):
    code, err = _convert(capsys, "mcore-to-hf", "--mcore-dir", str(hf_dir), "--out",
                         str(tmp_path / "out"))
    _assert_one_line_error(code, err, "is not an mcore-rl checkpoint")
    _assert_nothing_written(tmp_path / "out")


def test_mcore_to_hf_refuses_a_non_empty_output_directory(capsys, hf_dir, tmp_path):
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    code, err = _convert(capsys, "mcore-to-hf", "--mcore-dir", str(ckpt), "--out", str(hf_dir))
    _assert_one_line_error(code, err, "exists and is not empty")


def test_unsupported_architecture_is_reported_with_the_supported_list(capsys, hf_dir, tmp_path):
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    code, err = _hf_to_mcore(capsys, hf_dir, tmp_path / "out")
    _assert_one_line_error(code, err, "GPTNeoXForCausalLM", "supported: LlamaForCausalLM")


def test_cli_exits_non_zero_with_one_line_in_a_real_process(hf_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "convert", "hf-to-mcore", "--hf-dir",
         str(hf_dir), "--out", str(tmp_path / "out"), "--tp", "3"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mcore-rl convert: error: TP 3 does not divide num_attention_heads 4 and "
        "num_key_value_heads 2 and intermediate_size 256"]
    _assert_nothing_written(tmp_path / "out")
