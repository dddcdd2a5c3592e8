"""`TrainEngine`: forward and train steps over micro-batches through Megatron's schedules.

The only code in mcore-rl that knows Megatron-Core's pipeline schedules, DDP and optimizer.

Every rank passes the *same* global batch. The engine splits it over data-parallel ranks
(balanced by tokens), packs each rank's share into micro-batches by a token budget, runs
Megatron's forward(-backward) schedule (no pipelining, 1F1B, or interleaved 1F1B with
virtual stages) and returns results for the whole batch, in batch order, on every rank.

Loss normalisation is exact by construction: a loss function returns the *sum* of its loss
over a micro-batch and the number of units (tokens or sequences) it covers; Megatron is
run with ``calculate_per_token_loss`` so nothing is divided per micro-batch, and the final
gradient is divided once by the unit count summed over all micro-batches and DP ranks.
A token-mean therefore weighs every token of the global batch equally, however the
sequences fall into micro-batches and ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from mcore_rl.data.batch import Batch
from mcore_rl.parallel import ParallelContext, megatron_cpu_compat
from mcore_rl.parallel.agreement import backend_device
from mcore_rl.train.fused_head import reported_kept_ids
from mcore_rl.train.micro_batches import pack_micro_batches, split_for_data_parallel, units_of
from mcore_rl.train.moe_metrics import aux_loss_metrics, clear_aux_losses
from mcore_rl.train.routing_replay import ROUTES
from mcore_rl.train.shared_prompts import (SharedLayout, share_prompts, supports_shared_prompts,
                                           token_positions, unshare)

NO_TRUNCATION = (-1, 1.0)
"""(top_k, top_p) of an untruncated distribution."""

MAX_SUFFIX = "_max"
"""A loss function's metric whose name ends so is reduced by max over micro-batches and DP
ranks (and not divided by the units); every other metric is summed and divided."""

# loss_fn(outputs, micro_batch) -> (summed loss, unit count, {metric name: summed value})
LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, torch.Tensor | int, dict]]
# fn(outputs, micro_batch) -> {name: [b] or [b, T] tensor}
ForwardFn = Callable[[dict[str, torch.Tensor], Batch], dict[str, torch.Tensor]]


@dataclass
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    loss: float
    """Global loss: summed loss / summed unit count over all micro-batches and DP ranks."""
    grad_norm: float
    lr: float
    metrics: dict[str, float]
    """Each metric's global sum divided by the global unit count."""
    units: float
    """Global unit count (tokens or sequences) the loss covered."""
    applied: bool = True
    """False: a gradient (or the loss) was not finite on some rank, and the optimizer step
    was skipped on every rank (the weights are unchanged)."""


def ddp_buffers(chunk) -> list:
    """The parameter-and-gradient buffers of a Megatron DDP chunk ([] for a bare model)."""
    buffers = getattr(chunk, "buffers", None)
    if not isinstance(buffers, list):  # a bare module's ``buffers`` is its method
        return []
    return buffers + list(getattr(chunk, "expert_parallel_buffers", None) or [])


def shift_right(per_position: torch.Tensor) -> torch.Tensor:
    """[b, T] outputs at positions 0..T-1 -> aligned to the token each position predicts
    (column t holds the output at t-1; column 0 is 0)."""
    return torch.nn.functional.pad(per_position[:, :-1], (1, 0))


class TrainEngine:
    """Forward/train over micro-batches for one model (actor, critic, reference, RM).

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage).
        ctx: the parallel layout.
        kind: ``"lm"`` (outputs log-probs [and entropy]), ``"value"`` (scalar head
            outputs, aligned as ``values``) or ``"reward"`` (the scalar head's output at each
            sequence's last real token, ``reward`` [b]: a reward model).
        vocab_size: real vocabulary size (padded columns are excluded from log-probs).
        micro_batch_tokens: padded-token budget of one micro-batch.
        optimizer: ``(megatron_optimizer, scheduler)`` for trainable engines, else None.
        logprob_impl: implementation switch passed to the log-prob kernels.
        fused_lm_head: apply the LM head inside the log-prob, only at response tokens
            (`mcore_rl.train.fused_head`); outputs at other positions are then 0. False:
            the model's own output layer computes logits at every position.
        share_prompts: rows with the same prompt (a prompt's samples) compute it once per
            micro-batch (`mcore_rl.train.shared_prompts`); where the model supports it (see
            `shares_prompts`), else ignored.
        packing: each micro-batch runs as one sequence of its rows, without padding
            (`mcore_rl.train.packing`); ``micro_batch_tokens`` then budgets real tokens.
    """

    def __init__(self, chunks: list, ctx: ParallelContext, *, kind: str = "lm",
                 vocab_size: int | None = None, micro_batch_tokens: int = 4096,
                 optimizer=None, scheduler=None, logprob_impl: str = "auto",
                 fused_lm_head: bool = True, share_prompts: bool = False, packing: bool = False):
        if kind not in ("lm", "value", "reward"):
            raise ValueError(f"kind must be 'lm', 'value' or 'reward', got {kind!r}")
        self.model = chunks
        self.ctx = ctx
        self.kind = kind
        self.vocab_size = vocab_size
        self.micro_batch_tokens = micro_batch_tokens
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.logprob_impl = logprob_impl
        self.output_weight = None
        if kind == "lm" and fused_lm_head:
            from mcore_rl.train.fused_head import defer_output_layer

            self.output_weight = defer_output_layer(chunks)
        self.steps_done = 0
        self.routing = None
        """Routing replay of an MoE model built for it (`mcore_rl.train.routing_replay`)."""
        if getattr(chunks[0].config, "moe_enable_routing_replay", False):
            from mcore_rl.train.routing_replay import RoutingReplay

            self.routing = RoutingReplay(chunks)
        self.shares_prompts = share_prompts and supports_shared_prompts(chunks, ctx)
        """Whether micro-batches are laid out with shared prompts (requested, and the model is
        dense, with rotary or learned positions, on the local layer spec's attention, and
        not interleaved over gloo)."""
        if packing:
            from mcore_rl.train.packing import check_packing_supported

            check_packing_supported(chunks)
        if ctx.cp > 1 and getattr(chunks[0].config, "num_moe_experts", None):
            raise ValueError("parallel.cp > 1 with a mixture-of-experts model is not supported "
                             "yet; set parallel.cp: 1")
        self.packing = packing
        self._micro: list[Batch] = []
        self._layouts: dict[int, SharedLayout] = {}
        self.offloaded = False
        """Parameters, gradients and optimizer state wait in host memory (`offload`)."""

    # ----- what the model computes per micro-batch ------------------------------------
    def _head_outputs(self, output: torch.Tensor, mb: Batch, temperature: float,
                      with_entropy: bool, truncation: tuple[int, float] = NO_TRUNCATION,
                      ) -> dict[str, torch.Tensor]:
        """Per-token outputs aligned to the tokens they describe; 0 on padding. With a
        ``truncation`` (top_k, top_p) that cuts anything, log-probs and entropy are those of
        the truncated distribution and ``kept`` (1/0) says whether each token is in its kept
        set: the one the engine reported (``kept_ids`` in the micro-batch), else the one these
        logits give."""
        if self.ctx.cp > 1:
            return self._cp_head_outputs(output, mb, temperature, with_entropy, truncation)
        layout = self._layouts.get(id(mb))
        if layout is not None:
            output = unshare(output, layout)
        real = mb["attention_mask"].to(torch.float32)
        if self.kind in ("value", "reward"):
            values = output.float().reshape(output.shape[0], output.shape[1])
            if self.kind == "reward":  # the scalar head's output at the last real token
                last = (mb["attention_mask"].sum(-1) - 1).clamp(min=0)
                return {"reward": values[torch.arange(len(last), device=last.device), last]}
            return {"values": shift_right(values) * real}
        tp_group = self.ctx.tp_group if self.ctx.tp > 1 else None
        if self.output_weight is not None:
            from mcore_rl.train.fused_head import response_logprobs

            return response_logprobs(output, self.output_weight, mb, vocab_size=self.vocab_size,
                                     tp_group=tp_group, temperature=temperature,
                                     with_entropy=with_entropy, impl=self.logprob_impl,
                                     truncation=truncation)
        from mcore_rl.kernels import token_logprobs

        ids = mb["input_ids"]
        truncated = truncation != NO_TRUNCATION
        res = token_logprobs(
            output[:, :-1], ids[:, 1:], vocab_size=self.vocab_size,
            tp_group=tp_group, temperature=temperature,
            return_entropy=with_entropy, impl=self.logprob_impl,
            top_k=truncation[0], top_p=truncation[1], return_kept=truncated,
            kept_ids=reported_kept_ids(mb, truncated))
        res = list(res) if isinstance(res, tuple) else [res]
        names = ["logprobs"] + (["entropy"] if with_entropy else []) + (["kept"] if truncated else [])
        return {name: torch.nn.functional.pad(v.float(), (1, 0)) * real for name, v in zip(names, res)}

    def _cp_head_outputs(self, output: torch.Tensor, mb: Batch, temperature: float,
                         with_entropy: bool, truncation: tuple[int, float]) -> dict:
        """`_head_outputs` under context parallelism: ``output`` holds this rank's positions
        only; each output is computed there, placed in the whole sequence and summed over the
        CP group (`mcore_rl.parallel.context_parallel.cp_sum`). The sequences are the
        micro-batch's rows, or its packed row (`mcore_rl.train.packing`), whose outputs then
        go back to the rows."""
        from mcore_rl.parallel.context_parallel import cp_sum

        real = mb["attention_mask"].to(torch.float32)
        truncated = truncation != NO_TRUNCATION
        kept_tok = (mb["kept_ids"].long() - 1) if truncated and "kept_ids" in mb else None
        if self.packing:  # one packed row [1, S]
            from mcore_rl.train.packing import cp_local_positions, from_packed, to_packed

            layout = self._layouts[id(mb)]
            ids = layout.input_ids
            local = cp_local_positions(layout, self.ctx.cp, self.ctx.cp_rank).to(ids.device)
            S = ids.shape[1]
            resp = to_packed(mb["response_mask"], layout, mb["attention_mask"])
            if kept_tok is not None:
                kept_tok = to_packed(kept_tok + 1, layout, mb["attention_mask"]) - 1
            bounds = torch.tensor(layout.params.segment_bounds, device=ids.device)
            segment = torch.bucketize(torch.arange(S, device=ids.device), bounds[1:], right=True)
            nxt = (local + 1).clamp(max=S - 1)
            valid = (local + 1 < S) & (segment[nxt] == segment[local])

            def finish(x: torch.Tensor) -> torch.Tensor:
                return from_packed(x[..., None], layout, mb["attention_mask"])[..., 0]
        else:
            ids = mb["input_ids"]
            local = self._cp_positions(mb)
            S = ids.shape[1]
            resp = mb["response_mask"]
            nxt = (local + 1).clamp(max=S - 1)
            valid = local + 1 < S

            def finish(x: torch.Tensor) -> torch.Tensor:
                return x
        rows = ids.shape[0]
        group = self.ctx.cp_group

        def whole(values: torch.Tensor, columns: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            """[rows, len(columns)] at those columns of [rows, S] zeros, summed over CP."""
            full = values.new_zeros((rows, S), dtype=torch.float32)
            return cp_sum(full.index_copy(1, columns[keep], values[:, keep].float()), group)

        if self.kind in ("value", "reward"):  # position-aligned
            everywhere = torch.ones_like(local, dtype=torch.bool)
            values = finish(whole(output.float().reshape(rows, -1), local, everywhere))
            if self.kind == "reward":
                last = (mb["attention_mask"].sum(-1) - 1).clamp(min=0)
                return {"reward": values[torch.arange(len(last), device=last.device), last]}
            return {"values": shift_right(values) * real}
        # Position p predicts token p + 1: the labels (and what the loss reads) one column on.
        labels = ids[:, nxt]
        inside = valid[None, :].expand(rows, -1)
        kept = None if kept_tok is None else kept_tok[:, nxt]
        tp_group = self.ctx.tp_group if self.ctx.tp > 1 else None
        names = ["logprobs"] + (["entropy"] if with_entropy else []) + (["kept"] if truncated else [])
        common = dict(vocab_size=self.vocab_size, tp_group=tp_group, temperature=temperature,
                      return_entropy=with_entropy, impl=self.logprob_impl, top_k=truncation[0],
                      top_p=truncation[1], return_kept=truncated)
        if self.output_weight is not None:  # the fused head, at response tokens only
            from mcore_rl.kernels import linear_token_logprobs

            target = resp[:, nxt].bool() & inside
            res = linear_token_logprobs(output[target], self.output_weight, labels[target],
                                        kept_ids=None if kept is None else kept[target], **common)
            per_position = []
            for v in (list(res) if isinstance(res, tuple) else [res]):
                v = v.float()
                per_position.append(torch.zeros(target.shape, dtype=v.dtype,
                                                device=v.device).masked_scatter(target, v))
        else:
            from mcore_rl.kernels import token_logprobs

            res = token_logprobs(output, labels, kept_ids=kept, **common)
            per_position = [v.float() * inside for v in (list(res) if isinstance(res, tuple) else [res])]
        return {name: finish(whole(v, local + 1, valid)) * real
                for name, v in zip(names, per_position)}

    def _plan(self, batch: Batch) -> list[list[int]]:
        """This DP rank's micro-batches as index lists into ``batch``. Rows that share a
        ``pack_unit`` id (a DPO pair) stay on one rank and in one micro-batch; with shared
        prompts so do the rows of a ``group_id`` (a prompt's samples), unless there are too
        few groups for the ranks and stages."""
        lens = batch.seq_lens
        multiple = self.ctx.pp if self.ctx.vpp else 1

        def plan_with(units):
            mine = split_for_data_parallel(lens, self.ctx.dp, units)[self.ctx.dp_rank]
            if self.packing:
                from mcore_rl.train.packing import pack_by_tokens

                return pack_by_tokens(lens, mine, self.micro_batch_tokens, multiple_of=multiple,
                                      units=units)
            return pack_micro_batches(lens, mine, self.micro_batch_tokens, multiple_of=multiple,
                                      units=units)

        plan = None
        if "pack_unit" in batch:
            plan = plan_with(units_of(batch["pack_unit"], len(batch)))
        elif self.shares_prompts and "group_id" in batch:
            try:  # a prompt's samples stay together
                plan = plan_with(units_of(batch["group_id"], len(batch)))
            except ValueError:  # too few prompts for the ranks or stages: split them after all
                pass
        if plan is None:
            plan = plan_with(None)
        if self._experts_across_ranks:
            # Every micro-batch's expert layers exchange tokens with the other EP ranks, so
            # all ranks run as many micro-batches (the extra ones are all padding, no loss).
            count = self._max_over_dp(len(plan))
            plan += [[] for _ in range(count - len(plan))]
        return plan

    @property
    def _is_moe(self) -> bool:
        return bool(getattr(self.model[0].config, "num_moe_experts", None))

    @property
    def _experts_across_ranks(self) -> bool:
        return self._is_moe and self.ctx.ep > 1

    def _max_over_dp(self, *values: int) -> int | tuple[int, ...]:
        t = torch.tensor(values, dtype=torch.long)
        if self.ctx.dp > 1:
            t = t.to(backend_device(self.ctx.dp_group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.dp_group)
        return int(t[0]) if len(values) == 1 else tuple(int(v) for v in t)

    def _run_schedule(self, batch: Batch, plan: list[list[int]], step_fn, forward_only: bool,
                      collect: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Micro-batches go to the model's device (the batch itself stays where it was made).
        micro = [batch.select(idx).trimmed().to(self.ctx.device) for idx in plan]
        self._micro = micro
        self._layouts = {}
        if self.packing:
            self._pack(micro)
            uniform = None
        elif self.ctx.vpp and megatron_cpu_compat.is_applied():
            # Over gloo the interleaved schedule cannot exchange per-micro-batch shapes (the
            # shape messages of both directions to the same peer get crossed): give every
            # micro-batch one shape, filling with all-padding rows that carry no loss.
            rows, T = max(len(m) for m in micro), max(m.num_tokens for m in micro)
            micro = [m.padded_to(rows, T) for m in micro]
            uniform = True
        elif self._experts_across_ranks:
            # The all-gather dispatcher gathers equal-sized token blocks from the EP ranks:
            # one shape for every micro-batch on every rank.
            rows, T = self._max_over_dp(max(len(m) for m in micro), max(m.num_tokens for m in micro))
            micro = [m.padded_to(max(rows, 1), max(T, 1)) for m in micro]
            uniform = True
        else:
            uniform = False
        # context parallelism: 2 x cp chunks per sequence, each split over the TP ranks under SP
        multiple = 2 * self.ctx.cp if self.ctx.cp > 1 else 1
        if self.model[0].config.sequence_parallel and uniform is not None:
            multiple *= self.ctx.tp
        if multiple > 1 and uniform is not None:
            micro = [m.padded_to(len(m), -(-m.num_tokens // multiple) * multiple) for m in micro]
        self._micro = micro
        if self.shares_prompts and uniform is False:
            sp = self.ctx.tp if self.model[0].config.sequence_parallel else 1
            for m in micro:
                layout = share_prompts(m, self.model[0].config.hidden_size, multiple_of=sp)
                if layout is not None:
                    self._layouts[id(m)] = layout.to(self.ctx.device)
        shapes = [(lay.input_ids.shape[0], lay.num_tokens) if (lay := self._layouts.get(id(m)))
                  else (len(m), m.num_tokens) for m in micro]

        def iterator() -> Iterator[Batch]:
            return iter(micro)

        # Every virtual chunk walks the same micro-batch sequence.
        data = [iterator() for _ in self.model] if len(self.model) > 1 else iterator()
        config = self.model[0].config
        config.variable_seq_lengths = self.ctx.pp > 1 and not uniform
        if self.packing:
            config.variable_seq_lengths = self.ctx.pp > 1 and len({t for _, t in shapes}) > 1
        try:
            return get_forward_backward_func()(
                forward_step_func=step_fn, data_iterator=data, model=self.model,
                num_microbatches=len(micro), seq_length=max(t for _, t in shapes),
                micro_batch_size=max(r for r, _ in shapes), forward_only=forward_only,
                collect_non_loss_data=collect)
        finally:
            self._layouts = {}

    def _pack(self, micro: list[Batch]) -> None:
        """Each micro-batch's packed layout. Sequence parallelism needs a multiple of tp
        tokens; the interleaved schedule over gloo and expert parallelism need one length
        for every micro-batch (of every DP rank, under EP)."""
        from mcore_rl.train.packing import pack

        config = self.model[0].config
        multiple = self.ctx.tp if config.sequence_parallel else 1
        # context parallelism: every segment in 2 x cp chunks (each a multiple of tp under SP)
        segment = 2 * self.ctx.cp * multiple if self.ctx.cp > 1 else 1
        share = self.shares_prompts
        layouts = [pack(m, config.hidden_size, share=share, multiple_of=multiple,
                        segment_multiple=segment) for m in micro]
        if (self.ctx.vpp and megatron_cpu_compat.is_applied()) or self._experts_across_ranks:
            length = max(lay.num_tokens for lay in layouts)
            if self._experts_across_ranks:
                length = self._max_over_dp(length)
            layouts = [pack(m, config.hidden_size, share=share, multiple_of=multiple,
                            length=length, segment_multiple=segment) for m in micro]
        self._layouts = {id(m): lay.to(self.ctx.device) for m, lay in zip(micro, layouts)}

    def _run_model(self, model, mb: Batch):
        """The chunk's forward over a micro-batch. A mixture-of-experts model is told which
        tokens are padding, so its load-balancing loss counts only real tokens (Megatron
        routes padding all the same); a micro-batch of nothing but padding (one that evens
        out the ranks' micro-batch counts under expert parallelism) adds no such loss. A
        micro-batch with a shared layout runs as its shared rows."""
        layout = self._layouts.get(id(mb))
        if self.packing:
            return self._run_packed(model, layout)
        if layout is not None:
            with token_positions(model, layout.position_ids):
                return model(layout.input_ids, layout.position_ids,
                             attention_mask=layout.attention_mask)
        if not self._is_moe:
            return model(*self._model_inputs(mb), attention_mask=None)
        padding = mb["attention_mask"] == 0
        if not bool(padding.all()):
            return model(*self._model_inputs(mb), attention_mask=None, padding_mask=padding)
        config = self.model[0].config
        coeff, config.moe_aux_loss_coeff = config.moe_aux_loss_coeff, 0.0
        try:
            return model(*self._model_inputs(mb), attention_mask=None)
        finally:
            config.moe_aux_loss_coeff = coeff

    def _run_packed(self, model, layout):
        kwargs = dict(attention_mask=None, packed_seq_params=layout.params)
        if self.ctx.cp > 1:  # this CP rank's chunks of every segment
            from mcore_rl.train.packing import cp_local_positions

            local = cp_local_positions(layout, self.ctx.cp, self.ctx.cp_rank).to(layout.input_ids.device)
            return model(layout.input_ids[:, local], layout.position_ids[:, local], **kwargs)
        coeff = None
        if self._is_moe and bool(layout.padding.all()):  # evens out EP ranks: no aux loss
            config = self.model[0].config
            coeff, config.moe_aux_loss_coeff = config.moe_aux_loss_coeff, 0.0
        elif self._is_moe and bool(layout.padding.any()):
            kwargs["padding_mask"] = layout.padding
        try:
            if layout.exact_positions:
                with token_positions(model, layout.position_ids):
                    return model(layout.input_ids, layout.position_ids, **kwargs)
            return model(layout.input_ids, layout.position_ids, **kwargs)
        finally:
            if coeff is not None:
                self.model[0].config.moe_aux_loss_coeff = coeff

    def _model_inputs(self, mb: Batch):
        ids = mb["input_ids"]
        position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        if self.ctx.cp > 1:  # this CP rank's two chunks of every row
            local = self._cp_positions(mb)
            ids, position_ids = ids[:, local], position_ids[:, local]
        # Right padding + causal attention: no mask needed (see mcore_rl.data.batch).
        return ids, position_ids

    def _cp_positions(self, mb: Batch) -> torch.Tensor:
        from mcore_rl.parallel.context_parallel import chunk_positions

        return chunk_positions(mb.num_tokens, self.ctx.cp, self.ctx.cp_rank, mb["input_ids"].device)

    # ----- the devices, shared with a colocated engine -----------------------------------
    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory, freeing the device for a
        colocated engine: Megatron's ``offload_to_cpu`` of the optimizer and of the DDP
        buffers (gradients, and the parameters where a buffer holds them: the distributed
        optimizer's), the other parameters moved one by one. Nothing may read them until
        `reload`."""
        if self.offloaded:
            return
        if self.ctx.device.type != "cuda":
            raise RuntimeError("offload moves the trainer's state off a GPU; this engine is on "
                               f"{self.ctx.device.type}")
        if self.optimizer is not None:  # first: its parameters may be the model's own
            self.optimizer.offload_to_cpu()
        self._move_model(to_host=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True

    def _move_model(self, to_host: bool) -> None:
        """Each chunk's DDP buffers (gradients, and parameters where a buffer holds them)
        through Megatron's offload/reload, its other parameters one by one."""
        for chunk in self.model:
            buffers = ddp_buffers(chunk)
            in_buffers = bool(buffers) and all(b.param_data is not None for b in buffers)
            for buffer in buffers:
                move = buffer.offload_to_cpu if to_host else buffer.reload_from_cpu
                move(move_params=in_buffers, move_grads=True)
            if not in_buffers:
                for p in chunk.parameters():
                    p.data = p.data.to("cpu" if to_host else self.ctx.device)

    def _check_on_device(self) -> None:
        if self.offloaded:
            raise RuntimeError("the trainer's state is offloaded to host memory (offload); "
                               "reload it before a forward or an update")

    def reload(self) -> None:
        """Back from `offload` (gradients zeroed); nothing to do if not offloaded."""
        if not self.offloaded:
            return
        self._move_model(to_host=False)
        if self.optimizer is not None:
            self.optimizer.restore_from_cpu()
        torch.cuda.synchronize()
        self.offloaded = False

    # ----- public API ----------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: Batch, fn: ForwardFn | None = None, *, temperature: float = 1.0,
                with_entropy: bool = False, record_routes: bool = False, top_k: int = -1,
                top_p: float = 1.0) -> dict[str, torch.Tensor]:
        """Forward-only over the batch. Returns ``fn(outputs, micro_batch)`` (default: the
        outputs: ``logprobs``/``entropy`` or ``values``) for every sequence, in batch order,
        as [B] or [B, T] tensors, on every rank. ``top_k`` / ``top_p``: log-probs of the
        distribution truncated as the engine sampled (``kept`` then says which tokens lie in
        the kept set; `mcore_rl.kernels.token_logprobs`). ``record_routes`` (an MoE model built for
        routing replay): also the experts every token was routed to, as ``routes`` [B, T, L,
        k] over the model's L layers (`mcore_rl.train.routing_replay`), which a later
        `train_batch` of a batch carrying them replays. A batch that carries ``routes``
        (and is not being recorded) is routed by them here too."""
        self._check_on_device()
        fn = fn or (lambda outputs, mb: outputs)
        plan = self._plan(batch)
        recording = record_routes and self.routing is not None and self.routing.active
        replaying = not recording and self.routing is not None and self.routing.active \
            and ROUTES in batch
        recorded: list[tuple[int, int, dict]] = []

        def step(data_iterator, model):
            mb = next(data_iterator)
            if replaying:
                self._replay_routes(model, mb)
            output = self._run_model(model, mb)
            if recording:
                chunk = self._chunk_index(model)
                recorded.append((self._micro_index(mb), chunk, self._recorded_routes(chunk, mb)))

            def collect(output_tensor, non_loss_data=True):
                return {k: v.detach().float().cpu() for k, v in
                        fn(self._head_outputs(output_tensor, mb, temperature, with_entropy,
                                              (top_k, top_p)), mb).items()}

            return output, collect

        for m in self.model:
            m.eval()
        if recording:
            self.routing.start_recording()
        try:
            results = self._run_schedule(batch, plan, step, forward_only=True, collect=True)
        finally:
            if recording or replaying:
                self.routing.stop()
        results = self._from_last_stage(results)
        out = self._assemble(batch, plan, results)
        if recording:
            out[ROUTES] = self._assemble_routes(batch, plan, recorded)
        return out

    def _replay_routes(self, model, mb: Batch) -> None:
        routes = mb[ROUTES]
        if self.packing:  # the routes of the tokens in the order the model runs them
            from mcore_rl.train.packing import to_packed

            routes = to_packed(routes, self._layouts[id(mb)], mb["attention_mask"])
        self.routing.replay(self._chunk_index(model), routes)

    def _recorded_routes(self, chunk: int, mb: Batch) -> dict:
        if not self.packing:
            return self.routing.recorded(chunk, mb["attention_mask"])
        from mcore_rl.train.packing import from_packed

        layout = self._layouts[id(mb)]
        layers = self.routing.recorded(chunk, ~layout.padding.cpu())
        return {layer: from_packed(part, layout, mb["attention_mask"].cpu())
                for layer, part in layers.items()}

    def _chunk_index(self, model) -> int:
        return next(i for i, m in enumerate(self.model) if m is model)

    def _micro_index(self, mb: Batch) -> int:
        return next(i for i, m in enumerate(self._micro) if m is mb)

    def _assemble_routes(self, batch: Batch, plan: list[list[int]],
                         recorded: list[tuple[int, int, dict]]) -> torch.Tensor:
        """This rank's recorded routes in batch order, the other DP ranks' rows included."""
        routes = self.routing.empty(len(batch), batch.num_tokens).to(torch.int32)
        for micro, _, layers in recorded:
            rows = torch.as_tensor(plan[micro], dtype=torch.long)
            for layer, part in layers.items():
                part = part[:len(rows), :routes.shape[1]]  # rows/columns only evening out shapes
                routes[rows, :part.shape[1], layer] = part.to(torch.int32)
        if self.ctx.dp > 1:  # each row was recorded on one DP rank; 0 elsewhere
            dist.all_reduce(routes, op=dist.ReduceOp.MAX, group=self.ctx.dp_group)
        if self.routing.shard[1] > 1:  # and each position on one TP rank (sequence parallel)
            dist.all_reduce(routes, op=dist.ReduceOp.MAX, group=self.ctx.tp_group)
        return routes.to(torch.int16)

    def train_batch(self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0,
                    with_entropy: bool = False, lr: float | None = None, top_k: int = -1,
                    top_p: float = 1.0) -> StepResult:
        """One optimizer step over the whole batch (all micro-batches, all DP ranks).

        ``top_k`` / ``top_p``: the loss gets the truncated distribution's outputs (see
        `forward`).
        ``lr`` overrides the learning rate for this step only; the schedule does not advance.
        A batch carrying ``routes`` (recorded by `forward`) has its tokens routed to those
        experts (routing replay); a mixture-of-experts model reports Megatron's auxiliary
        losses (``moe/load_balancing_loss``, mean over its layers and micro-batches).
        """
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (forward only)")
        self._check_on_device()
        plan = self._plan(batch)
        replaying = self.routing is not None and self.routing.active and ROUTES in batch

        def step(data_iterator, model):
            mb = next(data_iterator)
            if replaying:
                self._replay_routes(model, mb)
            output = self._run_model(model, mb)

            def loss(output_tensor):
                total, units, metrics = loss_fn(
                    self._head_outputs(output_tensor, mb, temperature, with_entropy,
                                       (top_k, top_p)), mb)
                units = torch.as_tensor(units, dtype=torch.int).reshape(())
                report = {"loss": total.detach().clone().float(), "units": units.float(),
                          **{k: torch.as_tensor(v).detach().clone().float() for k, v in metrics.items()}}
                if self.ctx.cp_rank > 0:  # every CP rank has the whole loss; count it once
                    units = torch.zeros_like(units)
                return total, units, report

            return output, loss

        moe_layers = self.model[0].config.num_layers if self._is_moe else 0
        if moe_layers:
            clear_aux_losses()
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        try:
            reports = self._run_schedule(batch, plan, step, forward_only=False, collect=False)
        finally:
            if replaying:
                self.routing.stop()
        applied = self._grads_finite()
        grad_norm = float("nan")
        if applied:  # a non-finite gradient never reaches the weights
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            _, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm or 0.0)
            if self.scheduler is not None:
                # After an override, put back the schedule's rate (increment 0) for the next step.
                self.scheduler.step(increment=0 if lr is not None else 1)
            self.steps_done += 1
        else:
            self.optimizer.zero_grad()
        sums = self._reduce_reports(reports)
        units = sums.pop("units")
        loss = sums.pop("loss")
        denom = max(units, 1.0)
        metrics = {k: v if k.endswith(MAX_SUFFIX) else v / denom for k, v in sums.items()}
        if moe_layers:
            metrics |= aux_loss_metrics(sum(1 for rows in plan if rows), moe_layers)
        return StepResult(loss=loss / denom, grad_norm=grad_norm,
                          lr=self.optimizer.param_groups[0]["lr"], metrics=metrics, units=units,
                          applied=applied)

    def _grads_finite(self) -> bool:
        """Whether every gradient of every rank is finite (collective over the job): one
        reduction over each contiguous gradient buffer of Megatron's DDP."""
        grads = [buf.grad_data for chunk in self.model
                 for buf in (getattr(chunk, "buffers", None) or []) +
                 (getattr(chunk, "expert_parallel_buffers", None) or [])]
        if not grads:  # not wrapped in DDP
            grads = [g for chunk in self.model for p in chunk.parameters()
                     for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
        bad = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for g in grads:
            if not torch.isfinite(g.sum()):
                bad.fill_(1.0)
                break
        if self.ctx.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.ctx.world_group)
        return not bool(bad.item())

    def weights_finite(self) -> bool:
        """Whether every weight of every rank is finite (collective over the job)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for chunk in self.model:
            for p in chunk.parameters():
                if not torch.isfinite(p.detach().sum()):
                    bad.fill_(1.0)
                    break
        if self.ctx.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.ctx.world_group)
        return not bool(bad.item())

    # ----- moving results between ranks -----------------------------------------------
    def _from_last_stage(self, results: list) -> list:
        """Per-micro-batch results exist on the last pipeline stage only: share them."""
        if self.ctx.pp == 1:
            return results
        box = [results if self.ctx.is_last_stage else None]
        src = dist.get_process_group_ranks(self.ctx.pp_group)[-1]
        dist.broadcast_object_list(box, src=src, group=self.ctx.pp_group)
        return box[0]

    def _assemble(self, batch: Batch, plan: list[list[int]], results: list) -> dict[str, torch.Tensor]:
        """Scatter per-micro-batch results into batch order, then gather over DP ranks."""
        pieces = [(idx, res) for idx, res in zip(plan, results)]
        if self.ctx.dp > 1:
            gathered: list = [None] * self.ctx.dp
            dist.all_gather_object(gathered, pieces, group=self.ctx.dp_group)
            pieces = [p for rank_pieces in gathered for p in rank_pieces]
        B, T = len(batch), batch.num_tokens
        out: dict[str, torch.Tensor] = {}
        for idx, res in pieces:
            rows = torch.as_tensor(idx)
            for name, value in res.items():
                # drop rows and columns that only filled a uniform (or TP-divisible) shape
                value = value[:len(idx), :T] if value.dim() > 1 else value[:len(idx)]
                if name not in out:
                    shape = (B,) if value.dim() == 1 else (B, T, *value.shape[2:])
                    out[name] = torch.zeros(shape, dtype=value.dtype)
                if value.dim() == 1:
                    out[name][rows] = value
                else:
                    out[name][rows, :value.shape[1]] = value
        return out

    def _reduce_reports(self, reports: list[dict]) -> dict[str, float]:
        names = sorted(reports[0]) if reports else []
        if self.ctx.pp > 1:  # reports live on the last stage; every stage needs the names
            box = [names]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(self.ctx.pp_group)[-1],
                                       group=self.ctx.pp_group)
            names = box[0]
        # summed over micro-batches and DP ranks; a name ending in "_max": the largest value
        maxed = [n.endswith(MAX_SUFFIX) for n in names]
        local = torch.tensor([max((float(r[n]) for r in reports), default=-math.inf) if m else
                              sum(float(r[n]) for r in reports) for n, m in zip(names, maxed)],
                             dtype=torch.float64)
        if self.ctx.pp > 1 or self.ctx.dp > 1:
            local = local.to(backend_device(self.ctx.world_group))
        if self.ctx.pp > 1:
            dist.broadcast(local, src=dist.get_process_group_ranks(self.ctx.pp_group)[-1],
                           group=self.ctx.pp_group)
        if self.ctx.dp > 1:
            which = torch.tensor(maxed, dtype=torch.bool, device=local.device)
            if which.any():
                peak = torch.where(which, local, torch.full_like(local, -math.inf))
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.ctx.dp_group)
            dist.all_reduce(local, group=self.ctx.dp_group)
            if which.any():
                local = torch.where(which, peak, local)
        return dict(zip(names, local.tolist()))
