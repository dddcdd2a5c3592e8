"""The memory planner against ``torch.cuda.max_memory_allocated`` on a one-GPU Megatron model
(SmolLM2's shape, bf16, the local layer spec; skipped without CUDA)."""
import pytest
import torch

from mcore_rl.plan.memory import GIB, Shape, plan_memory
from tests.plan.test_memory import SMOLLM2

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recompute,tokens", [("none", 2048), ("full", 4096)])
def test_planned_bytes_are_within_15_percent_of_the_gpu_peak(recompute, tokens):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.data.batch import Batch
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    def loss(outputs, mb):
        mask = mb["response_mask"].float()
        return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}

    ctx = initialize_parallel(seed=1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    engine = build_engine(build_gpt_chunks(SMOLLM2, ctx, dtype="bf16", recompute=recompute), ctx,
                          vocab_size=SMOLLM2.vocab_size,
                          optim=OptimizerConfig(lr=1e-5, micro_batch_tokens=tokens))
    g = torch.Generator().manual_seed(0)
    batch = Batch.from_sequences(
        [torch.randint(0, SMOLLM2.vocab_size, (512,), generator=g).tolist()
         for _ in range(2 * tokens // 512)], prompt_lens=[128] * (2 * tokens // 512))
    engine.train_batch(batch.select([0]).trimmed(), loss)  # Adam's moments exist from here
    torch.cuda.reset_peak_memory_stats()
    engine.train_batch(batch, loss)
    measured = torch.cuda.max_memory_allocated() - base
    planned = plan_memory(Shape(arch=SMOLLM2, dtype="bf16", recompute=recompute,
                                micro_batch_tokens=tokens)).train_peak
    destroy_parallel()
    print(f"{recompute} {tokens}: planned {planned / GIB:.3f} GiB, measured {measured / GIB:.3f} GiB")
    assert abs(planned - measured) <= 0.15 * measured, \
        f"planned {planned / GIB:.2f} GiB, measured {measured / GIB:.2f} GiB"
