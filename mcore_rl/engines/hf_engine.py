"""`HFEngine`: transformers ``generate`` in the controlling process, the slow fallback.

No batching across prompts and no KV-cache reuse between calls: meant for tiny models,
tests and machines without vLLM. Log-probs follow mcore-rl's convention
(``log_softmax(logits / T)`` of the raw logits, untruncated; greedy uses T = 1). Each request
is sampled from its own seeded generator state, so a (prompt, seed) pair always gives the
same samples. Weight updates read the same shared-memory buckets as the other engines and
copy each HF-named tensor into the module's parameter.
"""
from __future__ import annotations

from pathlib import Path

import torch

from mcore_rl.errors import UsageError
from mcore_rl.engines.base import RolloutEngine, Rollouts, RolloutSample, SamplingConfig
from mcore_rl.wire import check_manifest, read_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class HFEngine(RolloutEngine):
    """A transformers causal LM loaded from ``model_dir`` (eager attention)."""

    name = "hf"

    def __init__(self, model_dir: str | Path, *, tp: int = 1, dtype: str = "fp32", seed: int = 0,
                 **_placement_and_limits):
        super().__init__()
        if tp != 1:
            raise UsageError(f"the hf engine runs unsharded: set rollout.engine_tp=1 (got {tp})")
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[dtype], attn_implementation="eager").eval()
        self.vocab_size = self.model.config.vocab_size
        self.seed = seed
        self._buffer: torch.Tensor | None = None

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int | None]) -> Rollouts:
        rollouts = Rollouts()
        greedy = sampling.temperature == 0
        stop = set(sampling.stop_token_ids)
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            torch.manual_seed(self.seed + i if seed is None else seed)
            ids = torch.tensor([prompt])
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p,
                top_k=None if greedy or sampling.top_k < 1 else sampling.top_k,
                max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens or None,
                num_return_sequences=sampling.n,
                eos_token_id=list(stop) or None, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True)
            temperature = 1.0 if greedy else sampling.temperature
            # logits [steps, n, V] of the raw model, before any sampling processor.
            logits = torch.stack(out.logits).float()[..., :self.vocab_size] / temperature
            logprobs = torch.log_softmax(logits, dim=-1)
            for j in range(sampling.n):
                tokens = out.sequences[j, len(prompt):].tolist()
                end = next((t + 1 for t, tok in enumerate(tokens) if tok in stop), None)
                tokens = tokens[:end] if end else tokens
                lp = [logprobs[t, j, tok].item() for t, tok in enumerate(tokens)]
                rollouts.samples.append(RolloutSample(
                    i, j, prompt, tokens, lp, "stop" if end else "length", self.weight_version))
        return rollouts

    def begin_update(self, path: str, nbytes: int, version: int) -> None:
        self._check_weights_awake()
        self._buffer = self._reader.open(path, nbytes)

    @torch.no_grad()
    def load_bucket(self, manifest: dict) -> float:
        import time

        start = time.perf_counter()
        check_manifest(self._buffer, manifest)
        for name, tensor in read_tensors(self._buffer, manifest):
            self.model.get_parameter(name).copy_(tensor)
        return time.perf_counter() - start

    def _finish_session(self, complete: bool) -> None:
        self._buffer = None
