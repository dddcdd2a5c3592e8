"""HF -> mcore -> HF is exact, and the mapping moves every element where it belongs.

- The converter writes the checkpoint Megatron itself writes at TP2 x PP2: same tensors,
  shapes, dtypes, chunks and values.
- HF -> mcore (written at TP2 x PP2) -> loaded by Megatron at another layout -> saved by
  Megatron -> HF reproduces every tensor bit for bit (fp32 and bf16; tied, untied, QKV bias, QK norm),
  sharded with an index, and ``from_pretrained`` reports no missing or unexpected keys.
- One element changed in one TP shard of ``linear_qkv`` and of ``linear_fc1`` changes exactly
  the matching element of ``k_proj`` and ``up_proj`` in the export, and nothing else.
"""
import json

import pytest
import torch

from mcore_rl.convert import convert_hf_to_mcore, convert_mcore_to_hf
from mcore_rl.convert.dcp_io import DCPReader
from mcore_rl.models.checkpoint import MODEL_DIR
from mcore_rl.models.safetensors_io import SafetensorsCheckpoint
from tests.models.tiny_hf import build_tiny_hf_model, load_hf, save_tiny_hf_model
from tests.world import shared_world


@pytest.fixture(scope="module")
def world():
    return shared_world(4)


def _hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    ckpt = SafetensorsCheckpoint(hf_dir)
    return {name: ckpt.read(name) for name in ckpt.names()}


def _load_edit_save(rank, world_size, source, out, layout, edits, dtype="fp32"):
    """Load ``source`` at ``layout``, apply ``edits`` on TP rank 1, save with Megatron."""
    from mcore_rl.models.checkpoint import HF_DIR, is_mcore_checkpoint, save_mcore_checkpoint
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    tp, pp = layout
    ctx = initialize_parallel(tp=tp, pp=pp)
    built = build_model(source, ctx, role="actor", dtype=dtype)
    params = dict(built.chunks[0].named_parameters())
    for name, index, delta in edits:
        if ctx.tp_rank == 1 and name in params:
            with torch.no_grad():
                params[name][index] += delta
    hf_files = f"{source}/{HF_DIR}" if is_mcore_checkpoint(source) else source
    save_mcore_checkpoint(built.chunks, out, built.spec, hf_files, {"tp": tp, "pp": pp})
    destroy_parallel()


@pytest.mark.parametrize("variant", ["qwen2-tied", "qwen3-untied"])
def test_converter_writes_the_checkpoint_megatron_writes_at_tp2xpp2(world, tmp_path, variant):
    hf_dir = save_tiny_hf_model(variant, tmp_path / "hf")
    ours = convert_hf_to_mcore(hf_dir, tmp_path / "ours", tp=2, pp=2, progress=False)
    world.run(_load_edit_save, str(hf_dir), str(tmp_path / "megatron"), (2, 2), [])
    a, b = DCPReader(ours / MODEL_DIR), DCPReader(tmp_path / "megatron" / MODEL_DIR)
    assert set(a.metadata.state_dict_metadata) == set(b.metadata.state_dict_metadata)
    def chunks(md):
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)

    for key, md in b.tensor_metadata().items():
        mine = a.tensor_metadata()[key]
        assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), key
        assert chunks(mine) == chunks(md), key
        assert torch.equal(a.read(key), b.read(key)), key
    theirs = tmp_path / "megatron" / MODEL_DIR
    assert json.loads((ours / MODEL_DIR / "metadata.json").read_text()) == \
        json.loads((theirs / "metadata.json").read_text())
    assert torch.load(ours / MODEL_DIR / "common.pt") == torch.load(theirs / "common.pt")


@pytest.mark.parametrize("variant,dtype,layout", [
    ("llama-tied", torch.float32, (1, 2)),
    ("qwen2-tied", torch.float32, (2, 1)),
    ("mistral-untied", torch.float32, (1, 1)),
    ("llama-untied", torch.bfloat16, (2, 1)),
    ("qwen3-untied", torch.float32, (2, 2)),
    ("qwen3-untied", torch.bfloat16, (1, 2)),
])
def test_hf_to_mcore_to_hf_is_bit_exact_through_another_layout(world, tmp_path, variant, dtype,
                                                               layout):
    hf_dir = tmp_path / "hf"
    build_tiny_hf_model(variant).to(dtype).save_pretrained(hf_dir)
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2, pp=2, progress=False)
    world.run(_load_edit_save, str(ckpt), str(tmp_path / "resaved"), layout, [],
              "bf16" if dtype == torch.bfloat16 else "fp32")
    out = convert_mcore_to_hf(tmp_path / "resaved", tmp_path / "hf2", max_shard_bytes=200_000,
                              progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    original, exported = _hf_tensors(hf_dir), _hf_tensors(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), f"{name} changed in the round trip"
    _, info = type(load_hf(hf_dir)).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_one_changed_shard_element_changes_exactly_the_matching_hf_element(world, tmp_path):
    hf_dir = save_tiny_hf_model("llama-untied", tmp_path / "hf")
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2, pp=2, progress=False)
    # TP2: rank 1 holds query group 1 (of 2). Its linear_qkv rows are [q heads 2,3 (64 rows);
    # k head 1 (32); v head 1 (32)], so local row 70 is k_proj row 32 + 6. Its linear_fc1
    # rows are [gate rows 128..255; up rows 128..255], so local row 130 is up_proj row 130.
    edits = [("decoder.layers.1.self_attention.linear_qkv.weight", (70, 5), 0.5),
             ("decoder.layers.1.mlp.linear_fc1.weight", (130, 7), 0.5)]
    world.run(_load_edit_save, str(ckpt), str(tmp_path / "edited"), (2, 1), edits)
    out = convert_mcore_to_hf(tmp_path / "edited", tmp_path / "hf2", progress=False)
    original, exported = _hf_tensors(hf_dir), _hf_tensors(out)
    changed = {}
    for name, tensor in original.items():
        for index in (exported[name] != tensor).nonzero().tolist():
            changed[name] = changed.get(name, []) + [tuple(index)]
    assert changed == {"model.layers.1.self_attn.k_proj.weight": [(38, 5)],
                       "model.layers.1.mlp.up_proj.weight": [(130, 7)]}
