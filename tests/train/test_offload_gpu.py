"""``train.offload``: the trainer's parameters, gradients and optimizer state leave the GPU
for host memory while a colocated engine generates, and come back unchanged (a one-GPU
Megatron model; skipped without CUDA)."""
import pytest
import torch

from tests.train.test_engine_layouts import VOCAB, arch, fixed_batch, token_mean_loss

pytestmark = pytest.mark.gpu


def _engine():
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(seed=5)
    optim = OptimizerConfig(name="adam", lr=1e-3, clip_grad=1.0, micro_batch_tokens=48)
    return build_engine(build_gpt_chunks(arch(False), ctx, dtype="bf16"), ctx, vocab_size=VOCAB, optim=optim)


def _params(engine):
    return {n: p.detach().float().cpu().clone() for n, p in engine.model[0].named_parameters()}


def test_a_model_without_ddp_moves_its_weights():
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(seed=5)
    reference = build_engine(build_gpt_chunks(arch(False), ctx, dtype="bf16"), ctx, vocab_size=VOCAB)
    before = reference.forward(fixed_batch())["logprobs"]
    reference.offload()
    assert all(p.device.type == "cpu" for p in reference.model[0].parameters())
    reference.reload()
    assert torch.equal(reference.forward(fixed_batch())["logprobs"], before)
    destroy_parallel()


def test_offload_frees_the_device_and_training_goes_on_as_without_it():
    from mcore_rl.parallel import destroy_parallel

    results = []
    for offload in (False, True):
        engine = _engine()
        engine.train_batch(fixed_batch(), token_mean_loss)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        if offload:
            with pytest.raises(RuntimeError, match="offloaded"):
                engine.forward(fixed_batch())
            engine.offload()
            freed = held - torch.cuda.memory_allocated()
            params = list(engine.model[0].parameters())
            # bf16 weights, fp32 main grads, fp32 main weights, Adam's two moments
            state = sum(p.numel() * (2 + 4 + 4 + 4 + 4) for p in params)
            assert freed >= 0.9 * state, (freed, state)
            for p in params:  # every weight and gradient off the device
                assert p.device.type == "cpu" or p.untyped_storage().nbytes() == 0
                assert p.main_grad.untyped_storage().nbytes() == 0
            engine.reload()
        engine.train_batch(fixed_batch(), token_mean_loss)
        results.append(_params(engine))
        destroy_parallel()
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name
