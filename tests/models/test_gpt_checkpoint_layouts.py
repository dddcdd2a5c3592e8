"""A Megatron GPT saved with distributed checkpointing at one TP loads at another, exactly."""
import os

import pytest
import torch
import torch.distributed as dist

from mcore_rl.models import ModelArch
from tests.world import shared_world

# GQA (4 heads, 2 KV groups), SwiGLU, RoPE, untied embeddings; vocab not a multiple of 64.
ARCH = ModelArch(vocab_size=250, hidden_size=64, intermediate_size=160, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def world():
    return shared_world(2)


def _logits(ctx, model, tokens):
    """Full-vocab logits [b, s, V] gathered over the TP group."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out = model(tokens, position_ids, attention_mask=None)
    return gather_from_tensor_model_parallel_region(out)


def _save_at_tp1_load_at_tp2(rank, world_size, ckpt_dir, corrupt):
    from megatron.core import dist_checkpointing

    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    tokens = torch.randint(0, ARCH.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ctx = initialize_parallel(tp=1, seed=1)
    (model,) = build_gpt_chunks(ARCH, ctx)
    before = _logits(ctx, model, tokens)
    if rank == 0:
        os.makedirs(ckpt_dir)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    dist.barrier()
    destroy_parallel()

    ctx = initialize_parallel(tp=2, seed=2)  # another seed: loading must overwrite everything
    (model,) = build_gpt_chunks(ARCH, ctx)
    fresh = _logits(ctx, model, tokens)
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    if corrupt:
        key = next(k for k in state if k.endswith("linear_qkv.weight"))
        state[key] = state[key].clone()
        state[key][0, 0] += 1e-2
    model.load_state_dict(state)
    after = _logits(ctx, model, tokens)
    destroy_parallel()
    rel = ((after - before).abs().max() / before.abs().max()).item()
    rel_fresh = ((fresh - before).abs().max() / before.abs().max()).item()
    return rel, rel_fresh, tuple(before.shape)


def test_tp1_checkpoint_loads_at_tp2_with_identical_logits(world, tmp_path):
    results = world.run(_save_at_tp1_load_at_tp2, str(tmp_path / "ckpt"), False)
    for rel, rel_fresh, shape in results:
        assert shape == (2, 12, ARCH.padded_vocab_size)
        assert rel_fresh > 1e-2, "a freshly initialised TP2 model must differ (test is blind)"
        assert rel <= 1e-6, f"TP2 logits after loading differ from TP1 by {rel:.3g} (relative)"


def test_changed_weight_after_load_is_detected_by_logit_comparison(world, tmp_path):
    results = world.run(_save_at_tp1_load_at_tp2, str(tmp_path / "ckpt"), True)
    assert all(rel > 1e-6 for rel, _, _ in results)
