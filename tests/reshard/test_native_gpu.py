"""Weight syncs through vLLM's own GPU backends (`mcore_rl.reshard.native`): refused on CPU
in one line; on GPUs with vLLM, a trainer at TP1 syncs into an engine started without
weights (``load_format="dummy"``), and the engine then generates exactly what an engine
started from the checkpoint generates (oracle: vLLM reading the checkpoint itself).

ipc runs on one GPU (the engine beside the trainer); nccl and sparse_nccl need a second GPU
for the engine (NCCL takes one rank per device). The wiring is also checked on CPU through a
stand-in trainer engine (`tests/reshard/test_stream_layouts.py`)."""
import os

import pytest
import torch

from mcore_rl.engines import SamplingConfig
from tests.models.tiny_hf import save_tiny_hf_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
GREEDY = SamplingConfig(n=1, temperature=0.0, max_new_tokens=8, seed=1)


def test_on_cpu_an_engine_refuses_vllms_gpu_backends_before_it_starts(tmp_path):
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from mcore_rl.engines.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="is a GPU backend of vLLM"):
        VLLMEngine(tmp_path, weight_transfer="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["ipc", "nccl", "sparse_nccl"])
def test_a_sync_through_vllms_backend_gives_the_engine_the_checkpoint(tmp_path, monkeypatch, backend):
    pytest.importorskip("vllm")
    if backend != "ipc" and torch.cuda.device_count() < 2:
        pytest.skip(f"{backend} needs a second GPU for the engine")
    from mcore_rl.config.sections import ReshardConfig
    from mcore_rl.engines.vllm_engine import VLLMEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.native import NativeWeightSync

    model_dir = str(save_tiny_hf_model("qwen2-tied", tmp_path / "model", seed=0))
    ctx = initialize_parallel()  # a world of one
    reference = VLLMEngine(model_dir, max_model_len=128, gpu_memory_utilization=0.2)
    try:
        expected = reference.generate(PROMPTS, GREEDY)
    finally:
        reference.close()
    if backend != "ipc":  # the engine on the second GPU
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    engine = VLLMEngine(model_dir, max_model_len=128, gpu_memory_utilization=0.2,
                        load_format="dummy", weight_transfer=backend)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    try:
        built = build_model(model_dir, ctx)
        cfg = ReshardConfig(transport=backend, delta=backend == "sparse_nccl")
        sync = NativeWeightSync.from_config(built.chunks, built.spec.arch, cfg, engines=[engine])
        stats = sync.sync(1)
        got = engine.generate(PROMPTS, GREEDY)
        assert engine.weight_version == 1 and engine.recorded_version() == "1"
        for a, b in zip(got.samples, expected.samples):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        if backend == "sparse_nccl":
            assert stats.changed_fraction == 1.0  # the first sync is full
            assert sync.sync(2).changed_fraction == 0.0  # nothing changed since
        sync.close()
    finally:
        engine.close()
        destroy_parallel()
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
