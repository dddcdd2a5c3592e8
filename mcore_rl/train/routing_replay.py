"""Routing replay for mixture-of-experts models: record which experts every token was
routed to in one pass, and route the same tokens to the same experts in a later one.

Why: the policy loss compares log-probs of two passes over the same tokens (the log-prob
pass before the update and the update's forward). In bf16, round-off that differs between
the passes (other micro-batch shapes, other ranks) can flip a near tie between two experts,
and a token routed elsewhere gets a different log-prob, so the importance ratio moves for
no reason the update can act on. Replaying the first pass's routes removes that source.

Routes of a batch are one tensor ``routes`` [B, T, L, k] (int16): for each token, for each
of the model's L layers, its k experts plus one; 0 where nothing was recorded (padding, the
last token of an engine's sample, which it never ran). They are kept per sequence, so the
later pass may cut the batch into other micro-batches and spread it over other
data-parallel ranks. Under pipeline parallelism each stage records and replays its own
layers (a stage's recording leaves the other stages' layers 0). An engine that reports its
routes (`mcore_rl.engines.RolloutSample.routes`) fills the same tensor, so the trainer can
replay the engine's choices just as its own.

Megatron's router (``moe_enable_routing_replay``, `mcore_rl.models.moe.MoeOptions`) keeps
one ``RouterReplay`` per router. They are addressed here through one model's chunks, never
through ``RouterReplay``'s process-wide list, so another model of the process (the frozen
reference, the critic) routes by itself: models never share replay state.

Legend: s tokens per sequence, b sequences of a micro-batch; a router sees the micro-batch's
tokens flattened sequence-position-major (``[s, b] -> s * b``), as Megatron lays out
hidden states; under sequence parallelism each TP rank sees its contiguous slice of the s
positions.
"""
from __future__ import annotations

import torch

ROUTES = "routes"
"""The batch field that holds recorded routes."""


def routers_of(chunk) -> list:
    """The MoE routers of one model chunk, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


class RoutingReplay:
    """Recording and replaying the routes of one model's chunks (see the module doc)."""

    def __init__(self, chunks: list):
        self.routers = [routers_of(c) for c in chunks]
        self.layers = [[r.layer_number - 1 for r in routers] for routers in self.routers]
        """Per chunk, the model layer (0-based, global over pipeline stages) of each router."""
        self.num_routers = sum(len(r) for r in self.routers)
        config = chunks[0].config
        self.num_layers, self.k = config.num_layers, config.moe_router_topk
        self.shard = (0, 1)
        """(rank, size) of the sequence split: under sequence parallelism each TP rank's
        routers see only its contiguous slice of every micro-batch's positions."""
        if config.sequence_parallel:
            from megatron.core import parallel_state

            self.shard = (parallel_state.get_tensor_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_world_size())
        if self.num_routers and any(r.router_replay is None for rs in self.routers for r in rs):
            raise ValueError("the model was built without routing replay "
                             "(MoeOptions(routing_replay=True))")

    @property
    def active(self) -> bool:
        return self.num_routers > 0

    def _set_action(self, action) -> None:
        for routers in self.routers:
            for router in routers:
                router.router_replay.set_router_replay_action(action)

    def start_recording(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set_action(RouterReplayAction.RECORD)

    def recorded(self, chunk_index: int, attention_mask: torch.Tensor) -> dict[int, torch.Tensor]:
        """Layer -> [b, s, k] routes (experts + 1; 0 at padding) of the micro-batch the chunk
        just ran, whose ``attention_mask`` is [b, s]."""
        b, s = attention_mask.shape
        lo, hi = self._slice(s)
        real = attention_mask.bool()[:, lo:hi, None]
        out = {}
        for router, layer in zip(self.routers[chunk_index], self.layers[chunk_index]):
            idx = router.router_replay.get_recorded_indices().reshape(hi - lo, b, self.k)
            full = torch.zeros((b, s, self.k), dtype=torch.int16)
            full[:, lo:hi] = torch.where(real, idx.transpose(0, 1).to(torch.int16) + 1, 0)
            out[layer] = full  # other TP ranks' slices stay 0 (a max over TP fills them)
        return out

    def _slice(self, s: int) -> tuple[int, int]:
        rank, size = self.shard
        return rank * (s // size), (rank + 1) * (s // size)

    def replay(self, chunk_index: int, routes: torch.Tensor) -> None:
        """Route the micro-batch the chunk runs next as ``routes`` [b, s, L, k] say. Tokens
        with nothing recorded (padding, an engine's last token, rows added to even out
        micro-batch shapes) go to experts 0..k-1: their outputs reach no log-prob of a real
        token (a token's log-prob depends on the positions before it)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        lo, hi = self._slice(routes.shape[1])
        b, s = routes.shape[0], hi - lo
        fallback = torch.arange(self.k, dtype=torch.long)
        for router, layer in zip(self.routers[chunk_index], self.layers[chunk_index]):
            chosen = routes[:, lo:hi, layer].to(torch.long)  # [b, s, k]
            missing = (chosen == 0).any(-1, keepdim=True)
            target = torch.where(missing, fallback, chosen - 1)
            router.router_replay.set_target_indices(target.transpose(0, 1).reshape(s * b, self.k))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def stop(self) -> None:
        """Back to the routers' own choice; what was recorded or set is dropped."""
        for routers in self.routers:
            for router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def empty(self, B: int, T: int) -> torch.Tensor:
        return torch.zeros((B, T, self.num_layers, self.k), dtype=torch.int16)
