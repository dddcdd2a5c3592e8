"""`plan_memory`: the bytes one trainer rank holds, itemised, from a config and a model
shape, before any device is rented (``mcore-rl plan memory CONFIG``).

The model follows what Megatron-Core and our train engine allocate:

- **weights** in the parameter dtype; under bf16 Megatron's optimizer keeps **fp32 main
  parameters** beside them, and DDP accumulates **fp32 gradients** (``main_grad``) in its
  buffers; **Adam** keeps two fp32 moments. The distributed optimizer shards the main
  parameters and the moments over the data-parallel ranks (the experts' over theirs).
- **activations**: what autograd saves per token and layer on the local layer spec (the
  norms' and linear layers' inputs, Q/K/V and the attention output, the SwiGLU inputs),
  for the micro-batch's ``optimizer.micro_batch_tokens`` tokens (real ones with
  ``train.packing``, padded rows otherwise: the budget bounds both), divided by CP (each
  layer then also keeps the keys and values gathered from the CP group);
  the hidden-size terms also by TP under sequence parallelism; ``selective`` recompute
  frees next to nothing with a fused attention kernel (no scores are kept), ``full`` keeps
  one input per layer and one layer's activations. The first pipeline stage holds ``pp`` micro-batches in flight (1F1B), a bit
  more when interleaved.
- **logits**: the model's [tokens, vocab/tp] output, its fp32 log-softmax and gradient, or,
  with the fused LM head, one chunk of 1,024 tokens' fp32 logits (their gradient made in
  place); and the output weight's gradient before DDP takes it.
- **engine** (``rollout.placement: colocated``): vLLM's pool, ``gpu_memory_utilization`` of
  the device (weights and KV cache), held while it generates; asleep while the trainer
  runs. With ``train.offload`` the trainer's state leaves the device meanwhile.
- **delta-sync baseline** (``reshard.delta``): the last synced weights in the wire dtype, in
  host memory on a relaying rank.

The figures are computed, not measured; `tests/plan/test_memory.py` holds them against the
measured growth of peak RSS on CPU within 15%.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mcore_rl.models.arch import ModelArch

GIB = 1024 ** 3
HEADROOM = 0.9
"""Share of the device the plan may fill: the rest is the CUDA context, NCCL's buffers and
the caching allocator's fragmentation."""
FUSED_HEAD_CHUNK = 1024
"""Tokens per chunk of the fused LM head (`mcore_rl.kernels.linear_token_logprobs`)."""


@dataclass
class Item:
    name: str
    bytes: float
    phase: str
    """train: on the device while the trainer computes; generate: while the engine
    generates; both; host: host memory."""
    note: str = ""


@dataclass
class MemoryPlan:
    layout: str
    device_bytes: float
    items: list[Item]
    train_peak: float
    generate_peak: float
    fits: bool
    advice: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.generate_peak)

    def to_dict(self) -> dict:
        return asdict(self) | {"peak": self.peak}


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a run: the model, the layout and the knobs."""

    arch: ModelArch
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None
    dtype: str = "bf16"
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    micro_batch_tokens: int = 4096
    fused_lm_head: bool = True
    colocated: bool = False
    engine_utilization: float = 0.5
    offload: bool = False
    delta_sync: bool = False
    wire_bytes: int = 2
    reference: bool = False
    critic: bool = False

    @classmethod
    def from_config(cls, cfg, arch: ModelArch, critic: bool = False) -> "Shape":
        """The shape of a config's run (``critic``: its advantage estimator trains one)."""
        p = cfg.parallel
        dp = p.dp or 1
        wire = {"fp32": 4, "bf16": 2, "fp16": 2}.get(cfg.reshard.wire_dtype,
                                                     2 if cfg.model.dtype == "bf16" else 4)
        return cls(arch=arch, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, dp=dp,
                   ep=p.ep, etp=p.etp, dtype=cfg.model.dtype, recompute=cfg.model.recompute,
                   sequence_parallel=p.sequence_parallel or (arch.is_moe and p.tp > 1),
                   distributed_optimizer=cfg.optimizer.distributed,
                   micro_batch_tokens=cfg.optimizer.micro_batch_tokens,
                   colocated=cfg.rollout.placement in ("colocated", "fused"),
                   engine_utilization=cfg.rollout.gpu_memory_utilization,
                   offload=cfg.train.offload, delta_sync=cfg.reshard.delta, wire_bytes=wire,
                   reference=cfg.algorithm.kl_coef > 0,
                   critic=critic)


def layer_params(arch: ModelArch) -> tuple[int, int]:
    """Parameters of one transformer layer: (dense part, experts), unsharded."""
    h, d = arch.hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if arch.qkv_bias else 0)
    attention += 2 * d if arch.qk_norm else 0
    norms = 2 * h
    if arch.is_moe:
        return attention + norms + h * arch.num_experts, \
            arch.num_experts * 3 * h * arch.moe_intermediate_size
    return attention + norms + 3 * h * arch.intermediate_size, 0


def rank_params(s: Shape, stage: str = "first") -> tuple[float, float]:
    """(dense, expert) parameters on a rank of the ``first`` or ``last`` pipeline stage: its
    layers split over TP (the experts over EP x ETP), and the embedding (first stage) or the
    output layer (last stage; a tied model keeps a copy there); both without PP."""
    a = s.arch
    dense, experts = layer_params(a)
    layers = a.num_layers / s.pp
    vocab = a.padded_vocab_size * a.hidden_size / s.tp
    if s.pp == 1:
        ends = vocab * (1 if a.tie_word_embeddings else 2) + a.hidden_size
    else:
        ends = vocab + (a.hidden_size if stage == "last" else 0)  # the final norm
    etp = s.etp or s.tp
    per_layer_dense = (dense - 2 * a.hidden_size) / s.tp + 2 * a.hidden_size
    return layers * per_layer_dense + ends, layers * experts / (s.ep * etp)


def activation_bytes_per_token_layer(s: Shape) -> float:
    """Bytes autograd keeps per token and layer (before CP), on the local layer spec."""
    a = s.arch
    elem = 2 if s.dtype == "bf16" else 4
    h = a.hidden_size / (s.tp if s.sequence_parallel else 1)
    d = a.kv_channels
    q, kv = a.num_attention_heads * d / s.tp, a.num_kv_heads * d / s.tp
    if a.is_moe:
        etp = s.etp or s.tp
        ffn = a.experts_per_token * a.moe_intermediate_size / etp
        ffn_extra = a.hidden_size * a.experts_per_token / (s.tp if s.sequence_parallel else 1)
    else:
        ffn, ffn_extra = a.intermediate_size / s.tp, 0.0
    # The residual stream's copies: each norm's input and normalised output, the QKV and
    # FC1 inputs, and the two residual sums with their bias-dropout-add outputs.
    stream = 10 * h
    # Q, K and V, attention's output and the projection's (contiguous) input. Selective
    # recompute checkpoints core attention, whose fused kernel keeps no scores: it frees
    # next to nothing here (measured), so it counts as none.
    attention = 3 * q + 2 * kv
    mlp = 4 * ffn + ffn_extra  # FC1's output (gate and up), SiLU's output, FC2's input
    return elem * (stream + attention + mlp)


def plan_memory(s: Shape, device_gib: float = 80.0) -> MemoryPlan:
    """The busiest trainer rank's bytes, itemised (the first or the last pipeline stage,
    whichever holds more while training), and whether they fit a device of ``device_gib``."""
    stages = ["first"] if s.pp == 1 else ["first", "last"]
    plans = [_stage_plan(s, stage, device_gib) for stage in stages]
    return max(plans, key=lambda p: (p.train_peak, p.generate_peak))


def _stage_plan(s: Shape, stage: str, device_gib: float) -> MemoryPlan:
    a = s.arch
    elem = 2 if s.dtype == "bf16" else 4
    dense, experts = rank_params(s, stage)
    params = dense + experts
    edp = max(1, s.dp * s.tp * s.cp // (s.ep * (s.etp or s.tp)))  # experts' data-parallel ranks
    sharded = dense / (s.dp * s.cp) + experts / edp
    kept = sharded if s.distributed_optimizer else params
    items = [Item("weights", params * elem, "both", f"{params / 1e9:.3f} B parameters in {s.dtype}")]
    if s.dtype == "bf16":
        items.append(Item("fp32 main parameters", 4 * kept, "both",
                          "sharded over DP" if s.distributed_optimizer else ""))
    items.append(Item("fp32 main_grad", 4 * params, "both", "DDP's gradient buffers"))
    items.append(Item("optimizer state (Adam)", 8 * kept, "both",
                      "two fp32 moments, sharded over DP" if s.distributed_optimizer else
                      f"two fp32 moments; {8 * sharded / GIB:.2f} GiB with optimizer.distributed"))
    if s.reference:
        items.append(Item("reference weights", params * elem, "both", "kl_coef > 0"))
    if s.critic:
        critic = params * (elem + 12 + (4 if s.dtype == "bf16" else 0))
        items.append(Item("critic (weights, grads, Adam)", critic, "both",
                          "a critic of the policy's size"))
    tokens = s.micro_batch_tokens / s.cp
    layers = a.num_layers / s.pp
    in_flight = 1.0
    if s.pp > 1 and stage == "first":  # 1F1B: the first stage holds pp micro-batches
        in_flight = s.pp * (1 + (s.pp - 1) / (s.pp * s.vpp)) if s.vpp else s.pp
    per_layer = activation_bytes_per_token_layer(s)
    if s.cp > 1:
        # Each layer keeps the keys and values gathered from the CP group (the whole
        # sequence) and each local chunk's copy of them up to its end: (2 + 1/(2 cp)) T.
        kv = 2 * a.num_kv_heads * a.kv_channels / s.tp * elem
        per_layer += kv * s.cp * (2 + 1 / (2 * s.cp))
    if s.recompute == "full":
        hidden = a.hidden_size / (s.tp if s.sequence_parallel else 1)
        act = tokens * (layers * in_flight * hidden * elem + per_layer)
    else:
        act = tokens * layers * in_flight * per_layer
    items.append(Item("activations", act, "train",
                      f"{s.micro_batch_tokens} tokens per micro-batch"
                      + (f" / CP{s.cp}" if s.cp > 1 else "")
                      + (f", {in_flight:g} in flight" if in_flight > 1 else "")
                      + f", recompute {s.recompute}"))
    vocab = a.padded_vocab_size / s.tp
    if stage == "last" or s.pp == 1:
        # and the output weight's gradient, before DDP adds it to main_grad
        weight_grad = vocab * a.hidden_size * elem
        if s.fused_lm_head:
            logits = min(tokens, FUSED_HEAD_CHUNK) * vocab * 4 + weight_grad
            note = (f"fused head: one chunk of {FUSED_HEAD_CHUNK} tokens' fp32 logits (their "
                    "gradient in place) and the output weight's gradient")
        else:
            logits = tokens * vocab * (elem + 4 + 4) + weight_grad
            note = ("the output layer's logits, their fp32 log-softmax and gradient, and the "
                    "output weight's gradient")
        items.append(Item("logits", logits, "train", note))
    trainer_state = sum(i.bytes for i in items if i.phase == "both")
    train_peak = sum(i.bytes for i in items if i.phase in ("train", "both"))
    device = device_gib * GIB
    generate_peak = 0.0
    if s.colocated:
        engine = s.engine_utilization * device
        items.append(Item("engine (weights + KV cache)", engine, "generate",
                          f"gpu_memory_utilization {s.engine_utilization}; asleep while "
                          "the trainer runs"))
        generate_peak = engine + (0.0 if s.offload else trainer_state)
    if s.delta_sync:
        items.append(Item("delta-sync baseline", params * s.wire_bytes, "host",
                          "the last synced weights, on a relaying rank"))
    usable = HEADROOM * device
    fits = max(train_peak, generate_peak) <= usable
    layout = _layout(s) + (f" ({stage} stage)" if s.pp > 1 else "")
    plan = MemoryPlan(layout=layout, device_bytes=device, items=items,
                      train_peak=train_peak, generate_peak=generate_peak, fits=fits)
    if not fits:
        plan.advice = advice(s, plan, usable)
    return plan


def _layout(s: Shape) -> str:
    parts = [f"TP{s.tp}", f"PP{s.pp}" + (f"xVPP{s.vpp}" if s.vpp else ""), f"CP{s.cp}", f"DP{s.dp}"]
    if s.ep > 1:
        parts.append(f"EP{s.ep}")
    return "x".join(parts)


def advice(s: Shape, plan: MemoryPlan, usable: float) -> list[str]:
    """Knobs that lower the peak, the largest saving first."""
    by = {i.name: i.bytes for i in plan.items}
    tips: list[tuple[float, str]] = []
    if plan.generate_peak > usable and not s.offload:
        tips.append((sum(i.bytes for i in plan.items if i.phase == "both"),
                     "train.offload: true (the trainer's state leaves the device while the "
                     "engine generates)"))
    if plan.generate_peak > usable:
        tips.append((by.get("engine (weights + KV cache)", 0) / 2,
                     "a lower rollout.gpu_memory_utilization, or rollout.placement: separate"))
    if not s.distributed_optimizer and s.dp * s.cp > 1:
        saved = by["optimizer state (Adam)"] * (1 - 1 / (s.dp * s.cp))
        tips.append((saved, "optimizer.distributed: true"))
    act = by.get("activations", 0)
    if s.recompute != "full" and act:
        tips.append((act * 0.8, "model.recompute: full"))
    if act:
        tips.append((act / 2, f"parallel.cp: {s.cp * 2} (or a smaller "
                              "optimizer.micro_batch_tokens)"))
    if not s.sequence_parallel and s.tp > 1 and act:
        tips.append((act * 0.3, "parallel.sequence_parallel: true"))
    if not s.fused_lm_head:
        tips.append((by.get("logits", 0), "the fused LM head"))
    weights = by["weights"] + by.get("fp32 main parameters", 0) + by["fp32 main_grad"] \
        + by["optimizer state (Adam)"]
    tips.append((weights / 2, f"parallel.tp: {s.tp * 2} or parallel.pp: {s.pp * 2} (more devices)"))
    return [t for _, t in sorted(tips, key=lambda t: -t[0])]


def format_plan(plan: MemoryPlan) -> str:
    rows = [f"{'item':32s} {'GiB':>9s}  phase     note"]
    for i in plan.items:
        rows.append(f"{i.name:32s} {i.bytes / GIB:9.2f}  {i.phase:8s}  {i.note}")
    usable = HEADROOM * plan.device_bytes
    rows.append(f"{'peak while training':32s} {plan.train_peak / GIB:9.2f}")
    if plan.generate_peak:
        rows.append(f"{'peak while generating':32s} {plan.generate_peak / GIB:9.2f}")
    verdict = "fits" if plan.fits else "does NOT fit"
    rows.append(f"{plan.layout}: {verdict} in {usable / GIB:.1f} GiB "
                f"({HEADROOM:.0%} of {plan.device_bytes / GIB:.0f} GiB per device)")
    for tip in plan.advice:
        rows.append(f"  try: {tip}")
    return "\n".join(rows)
