"""The rollout-engine interface: generate with per-token log-probs, take new weights, sleep.

Log-prob convention (shared with the trainer and the kernels): the log-prob of a sampled
token is that of the distribution it was sampled from: ``log_softmax(logits[..., :vocab] /
temperature)`` in fp32, truncated by top-k and then top-p when they are set and renormalised
over the kept set (vLLM's ``processed_logprobs``; `mcore_rl.kernels.token_logprobs` with
``top_k`` / ``top_p`` computes the same in the trainer).

Weight updates arrive as a session of buckets (`mcore_rl.reshard`): ``begin_update`` ->
``load_bucket`` per bucket -> ``finish_update`` (or ``abort_update``). Every sample records
the weight version it was generated with. After a failed sync the engine holds a mix of two
versions: it says so (`weight_version` is None, ``generate`` raises) until a sync succeeds.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from mcore_rl.wire import BucketReader, WeightSyncError

@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses (one request per prompt, ``n`` samples each)."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy. Log-probs are of logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 truncates the distribution (after top-k)."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    max_new_tokens: int = 64
    """Longest response."""
    min_new_tokens: int = 0
    """Stop tokens are masked until a response has this many tokens (for fixed-length
    benchmarks; engine log-probs then reflect that mask at those steps)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a response (kept as its last token, finish reason "stop")."""
    seed: int | None = None
    """Base seed: request i is sampled with seed + i (reproducible per prompt)."""
    return_routes: bool = False
    """Mixture-of-experts models: also report the experts each token was routed to
    (`RolloutSample.routes`; for an engine whose registry entry says ``returns_routes``)."""
    return_kept_ids: bool = False
    """Also report the ids top-k / top-p kept for every sampled token
    (`RolloutSample.kept_ids`; for an engine whose registry entry says ``returns_kept_ids``)."""

    def request_seed(self, i: int) -> int | None:
        return None if self.seed is None else self.seed + i


@dataclass
class RolloutSample:
    """One generated response."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """log p(token_ids[t] | prompt, token_ids[:t]) under the convention above."""
    finish_reason: str
    """"stop" (a stop token ended it) or "length" (max_new_tokens reached)."""
    weight_version: int | None
    """The version of the weights that generated its first token (its oldest)."""
    routes: torch.Tensor | None = None
    """[P + R - 1, L, k] experts each position of prompt + response was routed to, per layer
    (``SamplingConfig.return_routes``): every position the engine ran, which is all but the
    last token (never fed back). None when not asked for."""
    token_versions: list[int] | None = None
    """The weight version of each response token, where a sample continued under newer
    weights than it started with (a partial rollout); None: all ``weight_version``."""
    observation_mask: list[int] | None = None
    """Multi-turn episodes (`mcore_rl.envs`): 1 for each token of ``token_ids`` that the
    environment returned (masked out of the loss; its log-prob is 0), 0 for the engine's."""
    env_reward: float | None = None
    """Multi-turn episodes: the sum of the environment's rewards."""
    turns: int = 1
    """Engine turns of the response."""
    kept_ids: list[list[int]] | None = None
    """Per response token, the ids the sampling's top-k / top-p kept (an engine that reports
    its sampling mask); the trainer then renormalises over exactly those."""


def kept_ids_tensor(samples: list[RolloutSample], batch) -> torch.Tensor:
    """``kept_ids`` [B, T, K] int32 of the samples' sampling masks, each id + 1 at the column
    of the token it belongs to (0: none, as padding and prompt tokens have), K the largest set."""
    width = max((len(ids) for s in samples if s.kept_ids for ids in s.kept_ids), default=1)
    out = torch.zeros((*batch["input_ids"].shape, width), dtype=torch.int32)
    for i, s in enumerate(samples):
        p = len(s.prompt_token_ids)
        for t, ids in enumerate(s.kept_ids or []):
            out[i, p + t, :len(ids)] = torch.tensor(ids, dtype=torch.int32) + 1
    return out


@dataclass
class Rollouts:
    """The samples of one ``generate`` call, prompt-major (prompt 0's n samples first)."""

    samples: list[RolloutSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    def __getitem__(self, index):
        return self.samples[index]

    def to_batch(self, pad_id: int = 0):
        """A `Batch`: prompt + response tokens, masks, and ``rollout_logprobs`` [B, T]
        aligned to the token they describe (0 on prompt and padding); metadata per sample."""
        from mcore_rl.data.batch import Batch

        seqs = [s.prompt_token_ids + s.token_ids for s in self.samples]
        prompt_lens = [len(s.prompt_token_ids) for s in self.samples]
        batch = Batch.from_sequences(
            seqs, prompt_lens, pad_id=pad_id,
            finish_reason=[s.finish_reason for s in self.samples],
            weight_version=[s.weight_version for s in self.samples])
        logprobs = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        group = torch.tensor([s.prompt_index for s in self.samples], dtype=torch.long)
        for i, (s, p) in enumerate(zip(self.samples, prompt_lens)):
            logprobs[i, p:p + len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
        versions = torch.zeros(batch["input_ids"].shape, dtype=torch.long)
        for i, (s, p) in enumerate(zip(self.samples, prompt_lens)):
            token_versions = s.token_versions or [s.weight_version or 0] * len(s.token_ids)
            versions[i, p:p + len(s.token_ids)] = torch.tensor(token_versions, dtype=torch.long)
        batch = batch.with_tensors(rollout_logprobs=logprobs, group_id=group,
                                   token_versions=versions)
        if any(s.observation_mask is not None for s in self.samples):
            # observations inside a response: holes in its mask; the environment's rewards
            mask = batch["response_mask"].clone()
            for i, (s, p) in enumerate(zip(self.samples, prompt_lens)):
                if s.observation_mask:
                    mask[i, p:p + len(s.token_ids)] *= 1 - torch.tensor(s.observation_mask)
            batch = batch.with_tensors(response_mask=mask)
            batch.meta["env_reward"] = [s.env_reward or 0.0 for s in self.samples]
            batch.meta["turns"] = [s.turns for s in self.samples]
        if self.samples and self.samples[0].routes is not None:
            # as `mcore_rl.train.routing_replay` keeps them: experts + 1, 0 where none ran
            first = self.samples[0].routes
            routes = torch.zeros((*batch["input_ids"].shape, *first.shape[1:]), dtype=torch.int16)
            for i, s in enumerate(self.samples):
                routes[i, :len(s.routes)] = s.routes.to(torch.int16) + 1
            batch = batch.with_tensors(routes=routes)
        if any(s.kept_ids is not None for s in self.samples):
            batch = batch.with_tensors(kept_ids=kept_ids_tensor(self.samples, batch))
        return batch


@dataclass
class Request:
    """One submitted request: ``sampling.n`` samples of one prompt."""

    request_id: str
    prompt: list[int]
    sampling: SamplingConfig
    seed: int | None


class RolloutEngine(ABC):
    """An inference engine holding one copy of the policy (see module doc)."""

    name: str = "base"
    supports_sleep: bool = False
    """Whether ``sleep`` frees memory (KV cache, weights) on this engine and device."""

    def __init__(self) -> None:
        self.weight_version: int | None = 0
        self._torn: str | None = None
        self._asleep: set[str] = set()
        """What `sleep` released and no wake has restored yet: "weights", "kv_cache"."""
        self._awake = threading.Event()
        """Set while nothing is asleep: what `wait_awake` waits on."""
        self._awake.set()
        self.before_sleep: Callable[[], None] | None = None
        """Called at the start of `sleep` (in the engine's process): e.g. a role that streams
        requests through `submit`/`step` stops them there, so that nothing runs on a KV
        cache that sleep frees."""
        self._reader = BucketReader()  # the bucket file, for engines that read it in-process

    # ----- generation -----------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seeds: Sequence[int] | None = None) -> Rollouts:
        """``sampling.n`` responses per prompt; ``seeds`` (one per prompt) override the
        seeds derived from ``sampling.seed``."""
        if self._torn:
            raise WeightSyncError(self._torn)
        self._check_awake("generate()")
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        if seeds is None:
            seeds = [sampling.request_seed(i) for i in range(len(prompts))]
        return self._generate(prompts, sampling, list(seeds))

    @abstractmethod
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int | None]) -> Rollouts: ...

    # ----- request by request (continuous batching) -------------------------------------
    # submit -> step (repeatedly; finished requests come back) -> cancel (what is unfinished)
    # Between two steps the engine may take new weights; what then runs on is the caller's
    # choice (`mcore_rl.roles.continuous`).
    continuous: bool = False
    """Whether the engine runs every submitted request at once, admitting new ones as others
    finish. The default runs them one after another, each to its end, in `step`."""

    def submit(self, request: Request) -> None:
        """Queue ``request``; `step` runs it."""
        self._queued().append(request)

    def step(self) -> list[tuple[str, list[RolloutSample]]]:
        """Advance the submitted requests; those that finished, with their samples (the
        default: the oldest queued request, generated whole)."""
        queue = self._queued()
        if not queue:
            return []
        request = queue.pop(0)
        rollouts = self.generate([request.prompt], request.sampling, seeds=[request.seed])
        return [(request.request_id, list(rollouts.samples))]

    def cancel(self, request_ids: Sequence[str]) -> dict[str, list[RolloutSample]]:
        """Stop these requests; per request, what its samples had generated so far (an
        unfinished sample has finish reason "abort"; the default starts none early)."""
        queue = self._queued()
        cancelled = {r.request_id for r in queue if r.request_id in set(request_ids)}
        queue[:] = [r for r in queue if r.request_id not in cancelled]
        return {rid: [] for rid in cancelled}

    def sequences_in_flight(self) -> int:
        """Samples the engine is generating now (its batch occupancy)."""
        return 0

    def _queued(self) -> list[Request]:
        if not hasattr(self, "_request_queue"):
            self._request_queue: list[Request] = []
        return self._request_queue

    # ----- weights ----------------------------------------------------------------------
    @abstractmethod
    def begin_update(self, path: str, nbytes: int, version: int) -> None:
        """Start a weight-update session reading buckets from the file ``path``."""

    @abstractmethod
    def load_bucket(self, manifest: dict) -> float:
        """Check one bucket's checksums, then load it; seconds spent."""

    def finish_update(self, version: int) -> None:
        """End the session: the engine now serves ``version`` (prefix cache reset)."""
        self._finish_session(complete=True)
        self.reset_prefix_cache()
        self.weight_version, self._torn = version, None

    def abort_update(self, reason: str) -> None:
        """End a failed session; until the next successful one, refuse to generate."""
        try:
            self._finish_session(complete=False)
            self.reset_prefix_cache()
        finally:
            self.weight_version, self._torn = None, reason

    def apply_update(self, version: int, manifests: list[dict], *,
                     begin: tuple[str, int] | None = None, finish: bool = False,
                     wake: bool = False) -> float:
        """Several steps of a weight-update session in one call, so that an engine in another
        process costs one round trip per call: with ``begin`` (path, nbytes) wake the weights
        (``wake``) and start the session, then load ``manifests`` in order, then with
        ``finish`` end it and wake the KV cache (``wake``). Seconds spent."""
        start = time.perf_counter()
        if begin is not None:
            if wake:
                self.wake_weights()
            self.begin_update(*begin, version)
        for manifest in manifests:
            try:
                self.load_bucket(manifest)
            except Exception as err:
                if len(manifests) == 1:
                    raise
                raise RuntimeError(f"bucket {manifest['bucket'] + 1}/{manifest['num_buckets']} "
                                   f"({err})") from err
        if finish:
            self.finish_update(version)
            if wake:
                self.wake_kv_cache()
        return time.perf_counter() - start

    @abstractmethod
    def _finish_session(self, complete: bool) -> None:
        """End the session; ``complete``: every bucket arrived (False when aborting)."""

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt prefixes (their KV entries came from older weights)."""

    def attach_update_buffer(self, path: str, nbytes: int) -> None:
        """Map the bucket file now and keep it mapped, so that its path can be removed at once
        (the memory then lives exactly as long as some process maps it: no leftover file if
        a process dies). Later sessions with the same (path, nbytes) reuse the mapping."""
        self._reader.open(path, nbytes)

    def release_update_buffer(self) -> None:
        """Unmap the bucket file."""
        self._reader.close()

    def load_weights_from_dir(self, hf_dir: str, version: int) -> None:
        """Reload every weight from an HF checkpoint directory (the slow, naive path)."""
        raise NotImplementedError(f"the {self.name} engine cannot reload from a directory")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       bucket_mb: float = 64.0, shm_dir: str = "/dev/shm") -> None:
        """Load HF-named tensors (from this process) through the same bucket session."""
        from mcore_rl.engines.local_update import update_from_tensors

        update_from_tensors(self, named_tensors, version, int(bucket_mb * 2**20), shm_dir)

    @property
    def consistent(self) -> bool:
        """False after a failed sync left a mix of weight versions."""
        return self._torn is None

    # ----- memory: the colocated handoff ------------------------------------------------
    # sleep -> (the trainer updates) -> wake_weights -> weight sync -> wake_kv_cache -> generate
    def sleep(self) -> None:
        """Give the devices to the trainer: free the KV cache and offload the weights where
        supported (`supports_sleep`); elsewhere only fence. Generation is refused until both
        are awake again, a weight sync until the weights are."""
        if self.before_sleep is not None:
            self.before_sleep()
        if self.supports_sleep:
            self._release_memory()
        self._asleep = {"weights", "kv_cache"}
        self._awake.clear()

    def wake_weights(self) -> None:
        """Bring the weights back (before a weight sync writes into them)."""
        self._wake("weights")

    def wake_kv_cache(self) -> None:
        """Re-allocate the KV cache (after the sync, before generating)."""
        self._wake("kv_cache")

    def _wake(self, part: str) -> None:
        """Restore ``part`` ("weights" or "kv_cache"); once both are, end `wait_awake`."""
        if part in self._asleep and self.supports_sleep:
            self._restore_memory(part)
        self._asleep.discard(part)
        if not self._asleep:
            self._awake.set()

    def wake(self) -> None:
        """Both: weights, then KV cache."""
        self.wake_weights()
        self.wake_kv_cache()

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

    def wait_awake(self, timeout: float | None = None) -> bool:
        """Wait until the engine is awake (another thread of this process wakes it, e.g. a
        weight sync through `mcore_rl.flow.publish`); whether it is, within ``timeout``."""
        return self._awake.wait(timeout)

    def _check_awake(self, what: str) -> None:
        """Engines call it before they run the model (generation, a streaming step)."""
        if self._asleep:
            raise RuntimeError(f"the {self.name} engine is asleep ({', '.join(sorted(self._asleep))}): "
                               f"call wake() (or wake_weights() then wake_kv_cache()) before {what}")

    def _check_weights_awake(self) -> None:
        """Engines call it when a weight-update session begins."""
        if "weights" in self._asleep:
            raise RuntimeError(f"the {self.name} engine's weights are asleep: call wake_weights() "
                               "before syncing weights into it")

    def _release_memory(self) -> None:
        """Free the KV cache and offload the weights (engines with `supports_sleep`)."""
        raise NotImplementedError

    def _restore_memory(self, what: str) -> None:
        """Restore ``what`` ("weights" or "kv_cache") after `_release_memory`."""
        raise NotImplementedError

    def check_alive(self, what: str = "its last call") -> None:
        """Raise `EngineDiedError` (saying it died during ``what``) if the engine's processes
        are gone (engines that run in processes of their own)."""

    def close(self) -> None:
        """Stop the engine's processes."""
