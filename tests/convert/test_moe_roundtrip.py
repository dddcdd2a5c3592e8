"""Mixture-of-experts checkpoints: HF (per-expert safetensors) -> mcore -> HF is exact.

- The converter writes the checkpoint Megatron itself writes for a tiny Qwen3-MoE at
  TP2 x PP2 (experts stacked by layer and global expert index, each expert's fc1 split into
  its TP ranks' gate and up rows): same tensors, chunks, values and metadata.
- HF -> mcore (written at TP2 x PP2) -> loaded by Megatron at EP2, TP2 x PP2 or EP2 x PP2 ->
  saved by Megatron -> HF reproduces every tensor bit for bit (Qwen3-MoE with both
  ``norm_topk_prob`` settings, Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``; fp32 and
  bf16), and ``from_pretrained`` reports no missing or unexpected keys.
- One element changed in expert 5 of layer 1 (held by EP rank 1 as its local expert 1)
  changes exactly that element of that expert's ``up_proj`` in the export.
"""
import json

import pytest
import torch

from mcore_rl.convert import convert_hf_to_mcore, convert_mcore_to_hf
from mcore_rl.convert.dcp_io import DCPReader
from mcore_rl.models.checkpoint import MODEL_DIR
from mcore_rl.models.safetensors_io import SafetensorsCheckpoint
from tests.models.tiny_hf import load_hf
from tests.models.tiny_moe import save_tiny_moe_model
from tests.world import shared_world


@pytest.fixture(scope="module")
def world():
    return shared_world(4)


def _hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    ckpt = SafetensorsCheckpoint(hf_dir)
    return {name: ckpt.read(name) for name in ckpt.names()}


def _load_edit_save(rank, world_size, source, out, layout, edits, dtype="fp32"):
    """Load ``source`` at ``layout`` (tp, pp, ep), apply ``edits`` on EP rank 1 of the last
    pipeline stage, save with Megatron."""
    from megatron.core import parallel_state as ps

    from mcore_rl.models.checkpoint import HF_DIR, is_mcore_checkpoint, save_mcore_checkpoint
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    tp, pp, ep = layout
    ctx = initialize_parallel(tp=tp, pp=pp, ep=ep)
    built = build_model(source, ctx, role="actor", dtype=dtype)
    params = dict(built.chunks[0].named_parameters())
    for name, index, delta in edits:
        if ps.get_expert_model_parallel_rank() == 1 and ctx.is_last_stage and name in params:
            with torch.no_grad():
                params[name][index] += delta
    hf_files = f"{source}/{HF_DIR}" if is_mcore_checkpoint(source) else source
    save_mcore_checkpoint(built.chunks, out, built.spec, hf_files, {"tp": tp, "pp": pp, "ep": ep})
    destroy_parallel()


def test_converter_writes_the_checkpoint_megatron_writes_for_experts(world, tmp_path):
    hf_dir = save_tiny_moe_model("qwen3moe", tmp_path / "hf")
    ours = convert_hf_to_mcore(hf_dir, tmp_path / "ours", tp=2, pp=2, progress=False)
    world.run(_load_edit_save, str(hf_dir), str(tmp_path / "megatron"), (2, 2, 1), [])
    a, b = DCPReader(ours / MODEL_DIR), DCPReader(tmp_path / "megatron" / MODEL_DIR)
    assert set(a.metadata.state_dict_metadata) == set(b.metadata.state_dict_metadata)
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in b.tensor_metadata()

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
    ("qwen3moe", torch.float32, (1, 1, 2)),        # EP2
    ("qwen3moe-norm", torch.bfloat16, (2, 2, 1)),  # TP2 x PP2
    ("mixtral", torch.float32, (1, 2, 2)),         # EP2 x PP2
], ids=["qwen3moe-EP2", "qwen3moe-norm-bf16-TP2xPP2", "mixtral-EP2xPP2"])
def test_moe_hf_to_mcore_to_hf_is_bit_exact_through_a_layout(world, tmp_path, variant, dtype,
                                                              layout):
    hf_dir = save_tiny_moe_model(variant, tmp_path / "hf", dtype=dtype)
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2, pp=2, progress=False)
    world.run(_load_edit_save, str(ckpt), str(tmp_path / "resaved"), layout, [],
              "bf16" if dtype == torch.bfloat16 else "fp32")
    out = convert_mcore_to_hf(tmp_path / "resaved", tmp_path / "hf2", max_shard_bytes=300_000,
                              progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    original, exported = _hf_tensors(hf_dir), _hf_tensors(out)
    assert set(exported) == set(original)
    assert sum(".experts." in name for name in original) == 2 * 8 * 3
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), f"{name} changed in the round trip"
    _, info = type(load_hf(hf_dir)).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_one_changed_expert_element_changes_exactly_that_experts_hf_element(world, tmp_path):
    hf_dir = save_tiny_moe_model("qwen3moe", tmp_path / "hf")
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    # EP2 x PP2: PP rank 1 holds layer 1 (its local layer 0); EP rank 1 holds experts 4..7,
    # so its local expert 1 is expert 5. fc1 rows are [gate (64); up (64)]: row 70 is up row 6.
    edits = [("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", (70, 3), 0.5)]
    world.run(_load_edit_save, str(ckpt), str(tmp_path / "edited"), (1, 2, 2), edits)
    out = convert_mcore_to_hf(tmp_path / "edited", tmp_path / "hf2", progress=False)
    original, exported = _hf_tensors(hf_dir), _hf_tensors(out)
    changed = {name: [tuple(i) for i in (exported[name] != t).nonzero().tolist()]
               for name, t in original.items() if not torch.equal(exported[name], t)}
    assert changed == {"model.layers.1.mlp.experts.5.up_proj.weight": [(6, 3)]}
