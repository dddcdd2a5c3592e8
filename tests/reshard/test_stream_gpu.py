"""The stream from a trainer whose weights live on a GPU (device-to-host copies into the
bucket file, NCCL process group for the control messages), into the in-process HF engine.

Oracle as in test_stream_layouts.py: the HF checkpoint the trainer was built from, bit for
bit at an fp32 wire, its bf16 rounding at a bf16 wire. Also prints the sync throughput of a
~0.2 B-parameter model (GB/s of fp32 weights, device to engine).
"""
import pytest
import torch
from safetensors.torch import load_file

from tests.reshard.tiny_models import save_model


def _sync_into_hf_engine(ctx, hf_dir, start_dir, wire):
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.reshard.stream import WeightSync

    built = build_model(hf_dir, ctx)
    assert next(built.chunks[0].parameters()).is_cuda
    engine = HFEngine(start_dir)
    with WeightSync.build(built.chunks, built.spec.arch, engines=[engine], bucket_mb=64,
                          wire_dtype=wire) as sync:
        sync.sync(version=1)
        stats = sync.sync(version=2)
    return engine, stats


@pytest.mark.gpu
def test_a_cuda_trainer_streams_the_exact_hf_tensors_into_the_engine(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mcore_rl.parallel import destroy_parallel, initialize_parallel

    ctx = initialize_parallel()
    try:
        for variant in ("llama-untied", "qwen2-tied"):
            hf_dir = save_model(variant, tmp_path / variant, seed=0)
            start = save_model(variant, tmp_path / f"{variant}-start", seed=3)
            expected = load_file(hf_dir / "model.safetensors")
            for wire in (torch.float32, torch.bfloat16):
                engine, _ = _sync_into_hf_engine(ctx, hf_dir, start, wire)
                params = engine.model.state_dict()
                for name, tensor in expected.items():
                    assert torch.equal(params[name], tensor.to(wire).float()), (variant, wire, name)
        torch.manual_seed(0)
        big = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False))
        big.save_pretrained(tmp_path / "big")
        _, stats = _sync_into_hf_engine(ctx, tmp_path / "big", tmp_path / "big", torch.float32)
        print(f"\n[gpu stream] {stats.nbytes / 1e9:.2f} GB in {stats.total_s:.3f} s "
              f"({stats.gb_per_s:.2f} GB/s; transfer {stats.transfer_s:.3f} s, "
              f"engine apply {stats.apply_s:.3f} s, {stats.buckets} buckets)")
    finally:
        destroy_parallel(keep_process_group=False)
