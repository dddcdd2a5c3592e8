"""`SGLangEngine`: SGLang's offline ``Engine`` behind `RolloutEngine` (GPU only).

Weights: one SGLang weight-update session per sync (``begin_weight_update`` ...
``end_weight_update``), fed bucket by bucket with ``update_weights_from_tensor``: the
tensors are HF-named views of the shared-memory bucket (checked first), and SGLang's own
``load_weights`` fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` per TP
shard, exactly as `mcore_rl.engines.param_plan` describes (checked in CI against SGLang's
model code, ``tests/engines/data/sglang_manifest.json``). The radix (prefix) cache is
flushed once at the end, not per bucket. With ``reshard.transport=nccl`` (separate placement)
the weights come over NCCL instead, through SGLang's ``init_weights_update_group`` and
``update_weights_from_distributed`` (`transfer`, driven by
`mcore_rl.reshard.sglang_broadcast`; unverified).

Log-probs: SGLang's default sampler returns log(softmax(logits / T)) of the sampled token,
computed before top-k/top-p, which is mcore-rl's convention (``SGLANG_RETURN_ORIGINAL_LOGPROB``
must stay unset: it would drop the temperature). Samples of one prompt are separate requests
with seeds derived from the request seed, so n samples never share one random stream.
"""
from __future__ import annotations

from pathlib import Path

from mcore_rl.engines import sglang_shim
from mcore_rl.engines.base import RolloutEngine, Rollouts, RolloutSample, SamplingConfig
from mcore_rl.wire import WeightSyncError, check_manifest, read_tensors

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SAMPLE_SEED_STRIDE = 1_000_003


class SGLangEngine(RolloutEngine):
    """One SGLang engine with ``tp`` ranks for the HF model in ``model_dir``."""

    name = "sglang"
    supports_sleep = True

    def __init__(self, model_dir: str | Path, *, tp: int = 1, dtype: str = "fp32", seed: int = 0,
                 max_model_len: int = 1024, gpu_memory_utilization: float = 0.5,
                 load_format: str = "auto", **_placement):
        super().__init__()
        sglang = sglang_shim.require()
        self.engine = sglang.Engine(
            model_path=str(model_dir), tp_size=tp, dtype=DTYPES[dtype], random_seed=seed,
            context_length=max_model_len, mem_fraction_static=gpu_memory_utilization,
            skip_tokenizer_init=True, load_format=load_format, enable_memory_saver=True)
        self._buffer = None
        self.tp = tp
        self._groups: list[str] = []

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int | None]) -> Rollouts:
        inputs, params = [], []
        for prompt, seed in zip(prompts, seeds):
            for j in range(sampling.n):
                inputs.append(prompt)
                params.append({
                    "temperature": sampling.temperature, "top_p": sampling.top_p,
                    "top_k": sampling.top_k, "max_new_tokens": sampling.max_new_tokens,
                    "min_new_tokens": sampling.min_new_tokens,
                    "stop_token_ids": list(sampling.stop_token_ids) or None,
                    "sampling_seed": None if seed is None else seed + j * SAMPLE_SEED_STRIDE})
        outputs = self.engine.generate(input_ids=inputs, sampling_params=params,
                                       return_logprob=True)
        rollouts = Rollouts()
        for k, out in enumerate(outputs):
            i, j = divmod(k, sampling.n)
            meta = out["meta_info"]
            logprobs = [lp for lp, _tok, *_ in meta["output_token_logprobs"]]
            reason = "stop" if (meta.get("finish_reason") or {}).get("type") == "stop" else "length"
            rollouts.samples.append(RolloutSample(i, j, prompts[i], list(out["output_ids"]),
                                                  logprobs, reason, self.weight_version))
        return rollouts

    def begin_update(self, path: str, nbytes: int, version: int) -> None:
        self._check_weights_awake()
        self._buffer = self._reader.open(path, nbytes)
        self.engine.begin_weight_update()

    def load_bucket(self, manifest: dict) -> float:
        import time

        start = time.perf_counter()
        check_manifest(self._buffer, manifest)
        self.engine.update_weights_from_tensor(read_tensors(self._buffer, manifest),
                                               flush_cache=False)
        return time.perf_counter() - start

    def _finish_session(self, complete: bool) -> None:
        self._buffer = None
        self.engine.end_weight_update()

    def transfer(self, step: str, payload=None):
        """One step of a weight sync over NCCL from `mcore_rl.reshard.sglang_broadcast`:
        ``ranks`` (how many workers receive), ``check`` (weights awake), ``init`` (join the
        trainer's group: SGLang's ``init_weights_update_group`` arguments), ``update`` (one
        bucket: ``update_weights_from_distributed`` arguments), ``finish`` with the version,
        which this engine then serves (prefix cache flushed), ``abort`` with the reason (its
        groups dropped; it refuses to generate until a sync finishes) or ``shutdown``."""
        if step == "ranks":
            return self.tp
        if step == "check":
            self._check_weights_awake()
        elif step == "init":
            self._sglang("init_weights_update_group", **payload)
            self._groups.append(payload["group_name"])
        elif step == "update":  # no generation on a mix of old and new weights
            self.weight_version, self._torn = None, "a weight sync is in progress"
            self._sglang("update_weights_from_distributed", **payload, flush_cache=False)
        elif step == "finish":
            self.engine.flush_cache()
            self.weight_version, self._torn = int(payload), None
        elif step in ("abort", "shutdown"):
            if step == "abort":
                self.weight_version, self._torn = None, str(payload)
            for name in self._groups:
                try:
                    self.engine.destroy_weights_update_group(group_name=name)
                except Exception:  # noqa: BLE001 - a broken group may not come apart cleanly
                    pass
            self._groups = []
        return None

    def _sglang(self, method: str, **kwargs) -> None:
        """A call of SGLang's update API, which answers (success, message)."""
        result = getattr(self.engine, method)(**kwargs)
        ok, message = result if isinstance(result, tuple) else (True, "")
        if not ok:
            raise WeightSyncError(f"SGLang's {method}: {message}")

    def reset_prefix_cache(self) -> None:
        self.engine.flush_cache()

    def load_weights_from_dir(self, hf_dir: str, version: int) -> None:
        self.engine.update_weights_from_disk(str(hf_dir))
        self.weight_version, self._torn = version, None

    def _release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def _restore_memory(self, what: str) -> None:
        self.engine.resume_memory_occupation(tags=[what])  # SGLang's tags: "weights", "kv_cache"

    def close(self) -> None:
        self.engine.shutdown()
