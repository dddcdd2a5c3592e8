"""`HFEngine`: transformers ``generate`` in the controlling process, the slow fallback.

No batching across prompts and no KV-cache reuse between calls: meant for tiny models,
tests and machines without vLLM. Log-probs follow mcore-rl's convention
(the log-softmax of the scores generate samples from: after its processors, temperature,
top-k and top-p; greedy uses T = 1), and sampling
follows the `SamplingConfig` alone (a checkpoint's own sampling defaults are dropped). Each request
is sampled from its own seeded generator state, so a (prompt, seed) pair always gives the
same samples. Weight updates read the same shared-memory buckets as the other engines and
copy each HF-named tensor into the module's parameter (for mixture-of-experts layers, into
its expert's slice of the layer's fused expert tensors: transformers keeps them fused in
memory and names them per expert in checkpoints).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from mcore_rl.errors import UsageError
from mcore_rl.engines.base import RolloutEngine, Rollouts, RolloutSample, SamplingConfig
from mcore_rl.wire import check_manifest, read_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)"
                     r"\.weight$")
"""A per-expert checkpoint name: Qwen3-MoE's gate/up/down_proj, Mixtral's w1 (gate), w3 (up), w2 (down)."""
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fused_target(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The tensor of ``model`` that the checkpoint tensor ``name`` is: the parameter itself,
    or an expert's slice of its layer's fused ``experts.gate_up_proj`` [E, 2I, H] (gate then
    up) or ``experts.down_proj`` [E, H, I]. Mixtral's ``block_sparse_moe`` is ``mlp`` in memory."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _EXPERT.match(name)
    if match is None:
        return model.get_parameter(name)
    experts = model.get_submodule(f"{match['layer']}.experts")
    e, part = int(match["e"]), _PART[match["w"]]
    if part == "down":
        return experts.down_proj[e]
    inter = experts.gate_up_proj.shape[1] // 2
    return experts.gate_up_proj[e, :inter] if part == "gate" else experts.gate_up_proj[e, inter:]


def token_ids_only(config):
    """A ``GenerationConfig`` with only the special token ids of ``config``: ``generate`` fills
    every option it is not given from the model's config, and a checkpoint's sampling
    defaults (a repetition penalty, an n-gram ban) would make it sample from another
    distribution than the one the engine's log-probs describe (its `SamplingConfig`'s)."""
    from transformers import GenerationConfig

    ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return GenerationConfig(**{k: v for k, v in ids.items() if v is not None})


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
        self.model.generation_config = token_ids_only(self.model.generation_config)
        self.vocab_size = self.model.config.vocab_size
        self.seed = seed
        self._buffer: torch.Tensor | None = None

    def request_seed(self, i: int, seed: int | None) -> int:
        """The seed of the ``i``-th prompt of a call: its own, else the engine's seed + i."""
        return self.seed + i if seed is None else seed

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int | None]) -> Rollouts:
        rollouts = Rollouts()
        greedy = sampling.temperature == 0
        stop = set(sampling.stop_token_ids)
        recorder = RouteRecorder(self.model) if sampling.return_routes else None
        if recorder is not None and not recorder.routers:
            raise UsageError("return_routes: this model has no mixture-of-experts router")
        try:
            for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
                self._generate_one(rollouts, i, prompt, seed, sampling, greedy, stop, recorder)
        finally:
            if recorder is not None:
                recorder.close()
        return rollouts

    def _generate_one(self, rollouts: Rollouts, i: int, prompt: list[int], seed: int | None,
                      sampling: SamplingConfig, greedy: bool, stop: set, recorder) -> None:
        torch.manual_seed(self.request_seed(i, seed))
        rows = 1 if greedy else sampling.n  # greedy samples are all the same: decode one
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy or sampling.top_k < 1 else sampling.top_k,
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens or None,
            num_return_sequences=rows,
            eos_token_id=list(stop) or None, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True)
        # scores [steps, rows, V] after generate's processors (min-new-tokens mask,
        # temperature, top-k, top-p): the log-probs of the distribution sampled from
        scores = torch.stack(out.scores).float()[..., :self.vocab_size]
        logprobs = torch.log_softmax(scores, dim=-1)
        routes = recorder.take(rows) if recorder is not None else None
        for j in range(sampling.n):
            row = j % rows
            tokens = out.sequences[row, len(prompt):].tolist()
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in stop), None)
            tokens = tokens[:end] if end else tokens
            lp = [logprobs[t, row, tok].item() for t, tok in enumerate(tokens)]
            rollouts.samples.append(RolloutSample(
                i, j, prompt, tokens, lp, "stop" if end else "length", self.weight_version,
                None if routes is None else routes[row, :len(prompt) + len(tokens) - 1].clone()))

    def begin_update(self, path: str, nbytes: int, version: int) -> None:
        self._check_weights_awake()
        self._buffer = self._reader.open(path, nbytes)

    @torch.no_grad()
    def load_bucket(self, manifest: dict) -> float:
        import time

        start = time.perf_counter()
        check_manifest(self._buffer, manifest)
        for name, tensor in read_tensors(self._buffer, manifest):
            fused_target(self.model, name).copy_(tensor)
        return time.perf_counter() - start

    def _finish_session(self, complete: bool) -> None:
        self._buffer = None


class RouteRecorder:
    """The experts a transformers mixture-of-experts model routes each token to, caught at
    its routers (``*TopKRouter`` modules: Qwen3-MoE, Mixtral; they return logits, weights
    and the top-k indices) while ``generate`` runs: the prompt in one forward, then one
    token per forward."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self.calls[layer].append(output[2].detach())  # [rows * positions, k]
        return hook

    def take(self, rows: int) -> torch.Tensor:
        """[rows, positions, L, k] of the forwards since the last take (their tokens are
        laid out row-major, as the model flattens [rows, positions])."""
        layers = [torch.cat([c.reshape(rows, -1, c.shape[-1]) for c in calls], dim=1)
                  for calls in self.calls]
        self.calls = [[] for _ in self.routers]
        return torch.stack(layers, dim=2)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
