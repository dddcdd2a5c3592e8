"""A short supervised warm start on the task's reference answers (before RL).

Teaches a freshly initialised model the answer format (digits then end-of-sequence) so that
RL has something to sharpen; kept short, it leaves most answers wrong.
"""
from __future__ import annotations

import random

from mcore_rl.data.batch import Batch
from mcore_rl.errors import NonFiniteError
from mcore_rl.rl.phases import encode_prompts


def warm_start_answer(meta: dict, rng: random.Random) -> str:
    """The reference answer, or one drawn from the task's ``warm_start_answers``
    ([answer, probability] pairs) when it defines them."""
    choices = meta.get("warm_start_answers")
    if not choices:
        return str(meta["answer"])
    answers, weights = zip(*choices)
    return rng.choices(answers, weights=weights)[0]


def sft_batch(state, records, rng: random.Random) -> Batch:
    prompt_ids, metas, _ = encode_prompts(state.tokenizer, state.cfg, records)
    seqs, prompt_lens = [], []
    for ids, meta in zip(prompt_ids, metas):
        answer = state.tokenizer.encode(warm_start_answer(meta, rng)) + [state.tokenizer.eos_id]
        seqs.append(ids + answer)
        prompt_lens.append(len(ids))
    return Batch.from_sequences(seqs, prompt_lens=prompt_lens, pad_id=state.tokenizer.pad_id)


def nll_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def warm_start(state) -> list[float]:
    """``train.warm_start_steps`` supervised steps at ``train.warm_start_lr``; the losses."""
    cfg, losses = state.cfg.train, []
    stream_position = state.prompts.position
    rng = random.Random(cfg.seed)
    for _ in range(cfg.warm_start_steps):
        batch = sft_batch(state, state.prompts.take(cfg.warm_start_batch), rng)
        result = state.actor.train_batch(batch, nll_loss, lr=cfg.warm_start_lr)
        if not result.applied and cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"warm start step {len(losses) + 1}: the loss or gradient is not "
                                 f"finite (loss {result.loss:.4g}); the update was not applied; "
                                 "lower train.warm_start_lr, or set train.on_nonfinite=skip")
        losses.append(result.loss)
    state.prompts.position = stream_position  # RL sees the prompts from the start
    return losses
