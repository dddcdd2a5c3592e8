"""`HFBatchedEngine`: transformers forward passes over all prompts of a call as one batch.

The `hf` engine calls ``generate`` once per prompt, so each (prompt, seed) pair gives the
same samples whatever else is in the call. This engine trades that for throughput on small
models, where a per-sequence cost dominates (vLLM's scheduler and output processing on a
CPU, or one ``generate`` per prompt): the prompts of a call are left-padded into one batch,
prefilled together and decoded one token per forward with a shared KV cache.

Sampling still draws from one seeded generator per prompt, consuming it as ``generate`` does
(one multinomial draw over the prompt's ``n`` rows per token), and a prompt's rows leave the
batch only when all of them have ended. A call with one prompt therefore gives exactly the
`hf` engine's samples; with several, padding and batch shapes can move logits in their last
bits, which can flip a near-tied draw, as in any batched engine. Log-probs follow the same
convention (``log_softmax(logits / T)`` of the raw logits), and sampling follows the
`SamplingConfig` alone, as there.
"""
from __future__ import annotations

from pathlib import Path

import torch

from mcore_rl.engines.base import Rollouts, RolloutSample, SamplingConfig
from mcore_rl.engines.hf_engine import HFEngine
from mcore_rl.errors import UsageError

PAD_ID = 0
"""Token fed for left padding and after a row has ended (masked out / never read)."""


class HFBatchedEngine(HFEngine):
    """`HFEngine` that decodes every prompt of a call in one batch of at most
    ``max_batch_rows`` rows (prompts x samples; a call with more runs in several batches)."""

    name = "hf_batched"

    def __init__(self, model_dir: str | Path, *, max_batch_rows: int = 256, **kwargs):
        if max_batch_rows < 1:
            raise UsageError(f"max_batch_rows must be at least 1 (got {max_batch_rows})")
        super().__init__(model_dir, **kwargs)
        self.max_batch_rows = max_batch_rows

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int | None]) -> Rollouts:
        if sampling.return_routes:
            raise UsageError("return_routes: the hf_batched engine does not record routes; "
                             "use rollout.engine=hf")
        rollouts = Rollouts()
        for chunk in prompt_chunks(len(prompts), sampling.n, self.max_batch_rows):
            generators = [torch.Generator().manual_seed(self.request_seed(i, seeds[i])) for i in chunk]
            rollouts.samples.extend(self._decode(chunk, [prompts[i] for i in chunk], generators, sampling))
        return rollouts

    def step(self):
        """Runs every queued request that samples as the oldest does, as one batch."""
        queue = self._queued()
        if not queue:
            return []
        sampling = queue[0].sampling
        batch = [r for r in queue if r.sampling == sampling]
        # a request without a seed samples as it would alone (seed + 0)
        rollouts = self.generate([r.prompt for r in batch], sampling,
                                 seeds=[self.seed if r.seed is None else r.seed for r in batch])
        queue[:] = [r for r in queue if r.sampling != sampling]  # only once they have run
        by_prompt: list[list[RolloutSample]] = [[] for _ in batch]
        for s in rollouts.samples:
            by_prompt[s.prompt_index].append(s)
        for samples in by_prompt:
            for s in samples:
                s.prompt_index = 0  # each request is one prompt
        return [(r.request_id, samples) for r, samples in zip(batch, by_prompt)]

    def _decode(self, indices: list[int], prompts: list[list[int]], generators: list[torch.Generator],
                sampling: SamplingConfig) -> list[RolloutSample]:
        n, greedy = sampling.n, sampling.temperature == 0
        temperature = 1.0 if greedy else sampling.temperature
        stop = torch.tensor(sorted(sampling.stop_token_ids), dtype=torch.long)
        maskable = stop[stop < self.vocab_size]  # ids past the vocabulary are never sampled
        rows = len(prompts) * n
        width = max(len(p) for p in prompts)
        ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for g, p in enumerate(prompts):
            ids[g * n:(g + 1) * n, width - len(p):] = torch.tensor(p)
            mask[g * n:(g + 1) * n, width - len(p):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        # logits of the last position only, as generate asks for them (and a [rows, width,
        # vocab] tensor would outweigh the KV cache)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache = out.past_key_values

        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        kept: list[list[list[int]]] | None = [[] for _ in range(rows)] if sampling.return_kept_ids else None
        ended = torch.zeros(rows, dtype=torch.bool)
        groups = list(range(len(prompts)))  # prompts still in the batch, in batch order
        row_ids = torch.arange(rows)        # batch row -> row
        for t in range(sampling.max_new_tokens):
            logits = out.logits[:, -1, :self.vocab_size].float()
            del out
            scores = logits
            if t < sampling.min_new_tokens and len(maskable):
                scores[:, maskable] = float("-inf")
            if greedy:
                lp = torch.log_softmax(scores, dim=-1)
                chosen = scores.argmax(-1)
            else:
                # the log-probs of the distribution sampled from (vLLM's processed_logprobs)
                processed = truncate(scores / temperature, sampling.top_k, sampling.top_p)
                lp = torch.log_softmax(processed, dim=-1)
                probs = torch.softmax(processed, dim=-1)
                chosen = torch.cat([torch.multinomial(probs[k * n:(k + 1) * n], 1, generator=generators[g])[:, 0]
                                    for k, g in enumerate(groups)])
            live = ~ended[row_ids]
            chosen = torch.where(live, chosen, torch.full_like(chosen, PAD_ID))
            picked = lp.gather(-1, chosen[:, None])[:, 0]
            for b in live.nonzero()[:, 0].tolist():
                r = int(row_ids[b])
                tokens[r].append(int(chosen[b]))
                logprobs[r].append(float(picked[b]))
                if kept is not None:  # the sampling mask: what the truncation kept
                    kept[r].append(torch.isfinite(lp[b]).nonzero()[:, 0].tolist())
            if len(stop):
                ended[row_ids] |= live & torch.isin(chosen, stop)
            if t == sampling.max_new_tokens - 1:
                break
            done = ended[row_ids].view(len(groups), n).all(-1)
            if bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).repeat_interleave(n).nonzero()[:, 0]
                groups = [g for g, d in zip(groups, done.tolist()) if not d]
                cache.batch_select_indices(keep)
                row_ids, mask, positions, chosen = row_ids[keep], mask[keep], positions[keep], chosen[keep]
            mask = torch.cat([mask, mask.new_ones(len(row_ids), 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)

        return [RolloutSample(indices[r // n], r % n, prompts[r // n], tokens[r], logprobs[r],
                              "stop" if ended[r] else "length", self.weight_version,
                              kept_ids=None if kept is None else kept[r])
                for r in range(rows)]


def prompt_chunks(prompts: int, n: int, max_rows: int) -> list[list[int]]:
    """Consecutive prompt indices grouped so that each group has at most ``max_rows`` rows
    (``n`` per prompt; a prompt is never split, so a group has at least one prompt)."""
    per = max(1, max_rows // n)
    return [list(range(start, min(start + per, prompts))) for start in range(0, prompts, per)]


def truncate(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``scores`` [rows, V] with tokens outside the top ``top_k`` (if >= 1), then outside the
    smallest set whose probability reaches ``top_p`` (if < 1), set to -inf."""
    if 1 <= top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(-1) - probs
        drop = before >= top_p  # the mass before a token already reaches top_p; the first stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores
