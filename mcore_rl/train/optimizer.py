"""Megatron DDP, optimizer and learning-rate schedule for a list of model chunks."""
from __future__ import annotations

from mcore_rl.config import OptimizerConfig


def wrap_ddp(chunks: list, distributed_optimizer: bool) -> list:
    """Megatron DDP around each chunk: contiguous fp32 grad buffers reduced over DP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer)
    return [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]


def build_optimizer(cfg: OptimizerConfig, model: list, lr: float, bf16: bool):
    """Adam over the DDP-wrapped chunks; bf16 parameters get fp32 main parameters."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    mcfg = MegatronOptimizerConfig(
        optimizer=cfg.name, lr=lr, sgd_momentum=0.0, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=bf16, params_dtype=model[0].config.params_dtype,
        use_distributed_optimizer=cfg.distributed)
    return get_megatron_optimizer(mcfg, model, use_gloo_process_groups=False)


def build_scheduler(cfg: OptimizerConfig, optimizer, lr: float, total_steps: int):
    """Linear warm-up to ``lr``, then constant/linear/cosine decay to ``min_lr``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = max(total_steps, cfg.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.warmup_steps else lr, max_lr=lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=cfg.decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant")
