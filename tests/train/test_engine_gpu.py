"""The train engine on a GPU takes batches made on the CPU, as every caller makes them (the
engine's outputs, rewards and advantages live there): each micro-batch goes to the model's
device, and the results come back to the CPU. Oracles: the batch's own response-token count,
and the loss on the batch falling after a plain SGD step on it."""
import pytest
import torch

from tests.train.test_engine_layouts import VOCAB, arch, fixed_batch, token_mean_loss


@pytest.mark.gpu
def test_a_cuda_engine_trains_on_a_batch_made_on_the_cpu():
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(seed=5)
    try:
        assert ctx.device.type == "cuda"
        optim = OptimizerConfig(name="sgd", lr=0.05, clip_grad=0.0, micro_batch_tokens=48)
        engine = build_engine(build_gpt_chunks(arch(False), ctx), ctx, vocab_size=VOCAB - 3,
                              optim=optim)
        assert next(engine.model[0].parameters()).is_cuda
        batch = fixed_batch()
        assert batch["input_ids"].device.type == "cpu"
        response = batch["response_mask"].bool()

        before = engine.forward(batch)["logprobs"]
        assert before.device.type == "cpu" and before.shape == batch["input_ids"].shape
        assert (before[response] < 0).all() and (before[~response] == 0).all()
        result = engine.train_batch(batch, token_mean_loss)
        after = engine.forward(batch)["logprobs"]
    finally:
        destroy_parallel()
    assert result.applied and result.units == int(response.sum())
    assert result.loss == pytest.approx(float(-before[response].mean()), rel=1e-4)
    assert float(-after[response].mean()) < float(-before[response].mean())
