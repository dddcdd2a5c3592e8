"""A reward model on the ranks of a `ParallelContext`: texts -> one score per response.

Built collectively from ``reward.reward_model_path`` (`mcore_rl.rewards.reward_model`
resolves it and says how texts are tokenised and pooled), at the context's layout; a
forward-only `TrainEngine` of kind ``reward`` computes the scores, so any TP/PP/DP layout
works, and every rank gets every score.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mcore_rl.config import RewardConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.parallel import ParallelContext
from mcore_rl.rewards.reward_model import encode_exchanges, resolve_reward_model
from mcore_rl.train.engine import TrainEngine


@dataclass
class RewardModel:
    """A loaded reward model and the tokenizer it reads texts with."""

    engine: TrainEngine
    tokenizer: Tokenizer
    pad_id: int | None
    """HF's pooling pad token (None: pool at the last token)."""
    max_tokens: int
    """The model's positions."""

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[torch.Tensor, dict]:
        """Collective: [B] float32 scores of the responses to their prompts (the same on
        every rank), and ``{"reward/rm_truncated": n}`` (sequences cut to the positions)."""
        sequences, cut = encode_exchanges(self.tokenizer, prompts, responses, self.pad_id,
                                          self.max_tokens)
        batch = Batch.from_sequences(sequences, pad_id=self.tokenizer.pad_id)
        scores = self.engine.forward(batch)["reward"].float()
        return scores, {"reward/rm_truncated": float(cut)}


def build_reward_model(cfg: RewardConfig, ctx: ParallelContext, dtype: str = "fp32") -> RewardModel:
    """The reward model of ``cfg`` on this rank (collective over ``ctx``'s ranks)."""
    from mcore_rl.models import SCORE_HEAD, build_model, check_layout
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.train.build import build_engine
    from mcore_rl.train.checkpoint import load_engine

    source = resolve_reward_model(cfg.reward_model_path)
    if source.kind == "run":  # a train.job: rm checkpoint: the trained engine's model part
        arch = source.spec.arch
        check_layout(arch, ctx.tp, ctx.pp, ctx.vpp)
        chunks = build_gpt_chunks(arch, ctx, dtype, head=SCORE_HEAD, init_weights=False)
        engine = build_engine(chunks, ctx, kind="reward")
        load_engine(engine, source.weights, load_optimizer=False)
    else:  # an HF *ForSequenceClassification (converted on load) or an mcore-rl checkpoint
        built = build_model(source.weights, ctx, role="reward", dtype=dtype)
        arch = built.spec.arch
        engine = build_engine(built.chunks, ctx, kind="reward")
    return RewardModel(engine=engine, tokenizer=load_tokenizer(source.tokenizer_dir),
                       pad_id=source.pad_id, max_tokens=arch.max_position_embeddings)
