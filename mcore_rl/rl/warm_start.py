"""A short supervised warm start on the task's reference answers (before RL).

Teaches a freshly initialised model the answer format (digits then end-of-sequence) so that
RL has something to sharpen; kept short, it leaves most answers wrong.
"""
from __future__ import annotations

import random
import time
from typing import Callable

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.errors import NonFiniteError, UsageError
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
    """Prompts with their warm-start answers (end-of-sequence appended). With an environment
    an answer is a list of turns: the environment answers each turn but the last, and its
    observations are left out of the loss, as in the episodes RL trains on."""
    tok = state.tokenizer
    prompt_ids, metas, _ = encode_prompts(tok, state.cfg, records)
    seqs, prompt_lens, keeps = [], [], []
    for ids, meta in zip(prompt_ids, metas):
        answer = warm_start_answer(meta, rng)
        if isinstance(answer, str):
            answer, keep = tok.encode(answer) + [tok.eos_id], None
        else:
            answer, keep = transcript(state, meta, answer)
        seqs.append(ids + answer)
        prompt_lens.append(len(ids))
        keeps.append([1] * len(ids) + keep if keep else None)
    batch = Batch.from_sequences(seqs, prompt_lens=prompt_lens, pad_id=tok.pad_id)
    if any(keeps):
        mask = batch["response_mask"].clone()
        for i, keep in enumerate(keeps):
            if keep:
                mask[i, :len(keep)] *= torch.tensor(keep)
        batch = batch.with_tensors(response_mask=mask)
    return batch


def transcript(state, meta: dict, turns: list[str]) -> tuple[list[int], list[int]]:
    """The token ids of a scripted episode (each turn's text, end-of-sequence after the
    last, the environment's observation after the others) and 1/0 per token: the turns'."""
    from mcore_rl.envs import ENVIRONMENTS

    tok = state.tokenizer
    if not state.cfg.environment.name:
        raise UsageError("the task's warm-start answers are multi-turn transcripts, which need "
                         "its environment: set environment.name (e.g. calculator)")
    env = ENVIRONMENTS.get(state.cfg.environment.name)(tok)
    env.reset(meta)
    ids, keep = [], []
    for k, turn in enumerate(turns):
        own = tok.encode(turn) + ([tok.eos_id] if k == len(turns) - 1 else [])
        ids += own
        keep += [1] * len(own)
        if k < len(turns) - 1:
            observation = list(env.step(own).observation)
            ids += observation
            keep += [0] * len(observation)
    return ids, keep


def nll_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def to_console(line: str) -> None:
    """A `warm_start` report as a console line of the run."""
    print(f"mcore-rl: {line}", flush=True)


PROGRESS_EVERY_S = 30.0
"""How often a long warm start reports its progress (`warm_start`'s ``report``)."""


def warm_start(state, report: Callable[[str], None] | None = None,
               clock: Callable[[], float] = time.monotonic) -> list[float]:
    """``train.warm_start_steps`` supervised steps at ``train.warm_start_lr``; the losses.
    ``report`` (the rank that writes the console) gets a line when the warm start begins,
    then one every `PROGRESS_EVERY_S` seconds while it runs."""
    cfg, losses = state.cfg.train, []
    stream_position = state.prompts.position
    rng = random.Random(cfg.seed)
    if report is not None:
        report(f"warm start: {cfg.warm_start_steps} supervised steps of {cfg.warm_start_batch} "
               f"prompts on the task's answers (train.warm_start_*)")
    last_report = clock()
    for _ in range(cfg.warm_start_steps):
        batch = sft_batch(state, state.prompts.take(cfg.warm_start_batch), rng)
        result = state.actor.train_batch(batch, nll_loss, lr=cfg.warm_start_lr)
        if not result.applied and cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"warm start step {len(losses) + 1}: the loss or gradient is not "
                                 f"finite (loss {result.loss:.4g}); the update was not applied; "
                                 "lower train.warm_start_lr, or set train.on_nonfinite=skip")
        losses.append(result.loss)
        if report is not None and clock() - last_report >= PROGRESS_EVERY_S \
                and len(losses) < cfg.warm_start_steps:
            last_report = clock()
            report(f"warm start {len(losses)}/{cfg.warm_start_steps} steps, loss {result.loss:.3f}")
    state.prompts.position = stream_position  # RL sees the prompts from the start
    return losses
