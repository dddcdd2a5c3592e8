"""Where a `VLLMEngine`'s ``vllm.LLM`` lives, and every call into it.

- `HostedLLM`: the ``LLM`` inside one process of ours (`serve`), which runs vLLM's engine
  core and its worker in itself. Used on CPU at engine TP1.
- `LocalLLM`: the ``LLM`` in this process; vLLM starts its engine core (and its workers) in
  processes of its own, or, with ``in_process``, runs them all in this one.

Why a host: on CPU vLLM runs its worker in a process apart from the engine core even at TP1
(its OpenMP settings need a fresh process), and each of the two spawned processes imports
vLLM and torch. Measured on the 2-core CPU machine (the quick start's tiny Llama, 16 prompts
x 8 samples x 4 tokens): engine start 31 s in vLLM's two processes against 13 s in one
host; a generation 0.12-0.16 s against 0.08-0.09 s (one process hop fewer per engine step).
The host is still a fresh process that holds no trainer state, so the reasons the engine
does not run inside the trainer (`mcore_rl.engines.placement`) hold for it as they do for
vLLM's own processes.

Each call is a module-level function of the ``LLM`` (`generate`, `add_request`, `step`, ...),
so both places run the same code; what comes back is plain data (`Completion`).
"""
from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from mcore_rl.engines import vllm_shim

PROCESS_TITLE = "VLLM::EngineCore"
"""The host's name in ``ps`` (its command line), written as its target starts
(`mcore_rl.process_title`): the engine core runs in it, and it is named as vLLM names its
own engine core."""


@dataclass(frozen=True)
class Completion:
    """One sample of a request as the engine last reported it."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-prob of each sampled token."""
    finish_reason: str | None
    """"stop", "length", ... or None while the sample runs."""
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    """The weight versions vLLM recorded: (version, first token, end) per span of tokens
    generated under one version (vLLM reports them with a finished sample; None before)."""
    kept_ids: tuple[tuple[int, ...], ...] | None = None
    """Per token, the ids top-k / top-p kept (vLLM's sampling mask; with
    ``return_sampling_mask`` only)."""


def _completions(output) -> list[Completion]:
    return [Completion(c.index, tuple(c.token_ids),
                       tuple(step[tok].logprob for step, tok in zip(c.logprobs or [], c.token_ids)),
                       c.finish_reason,
                       None if getattr(c, "weight_versions", None) is None else
                       tuple((str(v.version), v.start, v.end) for v in c.weight_versions),
                       None if getattr(c, "sampling_mask", None) is None else
                       tuple(tuple(ids) for ids in c.sampling_mask.token_ids))
            for c in output.outputs]


# ----- the calls (run where the LLM is) ---------------------------------------------------
def generate(llm, prompts: list[list[int]], params: list) -> list[list[Completion]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [_completions(out) for out in outputs]


def add_request(llm, request_id: str, prompt: list[int], params) -> None:
    vllm_shim.add_streaming_request(llm, request_id, prompt, params)


def step(llm) -> list[tuple[str, list[Completion]]]:
    """One engine step: each request it reported on, with its samples so far (``AsyncLLM``:
    the requests in which a sample finished since the last call). Nothing when no
    request is unfinished (another caller stepped them to the end): vLLM's step would then
    wait for outputs that never come."""
    if not llm.llm_engine.has_unfinished_requests():
        return []
    streamed = getattr(llm, "streamed", None)  # AsyncLLM's own loop ran them meanwhile
    if streamed is not None:
        return streamed()
    return [(out.request_id, _completions(out)) for out in llm.llm_engine.step()]


def tokens_so_far(llm) -> dict[str, list[int]]:
    """``AsyncLLM``: per request in flight, the tokens of each of its samples so far."""
    return llm.tokens_so_far()


def abort(llm, request_ids: list[str]) -> None:
    llm.llm_engine.abort_request(request_ids)


def pause(llm, mode: str) -> None:
    """vLLM's ``pause_generation`` (``AsyncLLM``): ``mode`` "keep" or "abort", the KV cache
    and prefix cache cleared (a kept request recomputes its KV under the new weights)."""
    llm.pause_generation(mode=mode, clear_cache=True)


def resume(llm) -> None:
    llm.resume_generation()


def collective_rpc(llm, method: str, args: tuple) -> list:
    return llm.collective_rpc(method, args=args)


# ----- a weight sync through vLLM's weight-transfer protocol (`mcore_rl.engines.vllm_transfer`)
def transfer_reports(llm) -> list:
    """Each worker's ``("ok", report dict)`` or ``("error", message)``."""
    return llm.collective_rpc("mcore_rl_transfer_report")


def init_transfer(llm, init_info: dict) -> list:
    llm.init_weight_transfer_engine({"init_info": init_info})
    return transfer_reports(llm)


def _failed(reports: list) -> bool:
    return any(status != "ok" or value["error"] is not None for status, value in reports)


def weight_update(llm, start: bool, manifests: list[dict],
                  finish_version: str | None) -> tuple[list, bool]:
    """Steps of one session in one call (one round trip to an engine host): with ``start``
    the protocol's ``start_weight_update``, then ``update_weights`` with ``manifests`` (when
    any), then with ``finish_version`` ``finish_weight_update`` and the version recorded,
    unless a worker reported an error. The workers' reports after the last step, and whether
    the session ended."""
    if start:
        llm.start_weight_update()
    if manifests:
        llm.update_weights({"update_info": {"manifests": manifests}})
    reports = transfer_reports(llm)
    if finish_version is None or _failed(reports):
        return reports, False
    llm.finish_weight_update()
    reports = transfer_reports(llm)
    if not _failed(reports):
        llm.update_weight_version(finish_version)
    return reports, True


def protocol_step(llm, step: str, payload) -> None:
    """One call of vLLM's weight-transfer protocol as its own GPU backends drive it
    (`mcore_rl.reshard.native`): ``init`` (the backend's init info), ``start``, ``update``
    (one round's update info), ``finish`` (and ``payload``, the version, recorded), ``abort``
    (a failed sync: the session and the backend ended) or ``shutdown``."""
    if step == "init":
        llm.init_weight_transfer_engine({"init_info": payload})
    elif step == "start":
        llm.start_weight_update()
    elif step == "update":
        llm.update_weights({"update_info": payload})
    elif step == "finish":
        llm.finish_weight_update()
        llm.update_weight_version(str(payload))
    elif step == "abort":  # end whatever session is open; the backend is rebuilt next
        for end in (llm.finish_weight_update, llm.shutdown_weight_transfer_engine):
            try:
                end()
            except Exception:  # noqa: BLE001 - nothing was open, or the group is gone
                pass
    elif step == "shutdown":
        llm.shutdown_weight_transfer_engine()
    else:
        raise ValueError(f"unknown weight-transfer step {step!r}")


def end_weight_update(llm, reason: str) -> None:
    """End a session that failed (``reason``): nothing more loads, ``finish_weight_update``
    restores the model's modules, and the version is not recorded."""
    llm.update_weights({"update_info": {"abort": reason}})
    llm.finish_weight_update()


def set_weight_version(llm, version: str) -> None:
    llm.update_weight_version(version)


def weight_version(llm) -> str:
    return llm.get_weight_version()


def release_transfer(llm) -> None:
    llm.shutdown_weight_transfer_engine()


def reset_prefix_cache(llm) -> bool:
    return llm.reset_prefix_cache()


def sleep(llm, level: int) -> None:
    llm.sleep(level=level)


def wake_up(llm, tags: list[str]) -> None:
    llm.wake_up(tags=tags)


# ----- where the LLM is -------------------------------------------------------------------
class LocalLLM:
    """The ``LLM`` in this process."""

    def __init__(self, llm_kwargs: dict[str, Any]):
        self.llm = vllm_shim.require().LLM(**llm_kwargs)

    def call(self, fn: Callable, *args):
        return fn(self.llm, *args)

    def shutdown(self, kill_processes: Callable[[], None]) -> None:
        client = self.llm.llm_engine.engine_core
        _quiet_engine_monitor(client)
        kill_processes()
        client.shutdown()  # its processes are gone: this releases the client's side
        self.llm = None


def _quiet_engine_monitor(client) -> None:
    """Tell vLLM's engine-core monitor (a thread of the client) that the processes it
    watches are being ended on purpose, so that it neither reports them as died nor starts
    a shutdown of its own (whose grace period would log "force killing" for a process
    that is merely being reaped)."""
    resources = getattr(client, "resources", None)
    if resources is None:
        return
    resources.engine_dead = True
    manager = getattr(resources, "engine_manager", None)
    if manager is not None and hasattr(manager, "manager_stopped"):
        manager.manager_stopped.set()
        manager._finalizer.detach()


class EngineHostError(RuntimeError):
    """The engine host could not start the engine, or lost its connection."""


class HostedLLM:
    """The ``LLM`` in a spawned process of ours (`serve`); `call` sends it a function and
    waits for the result. Started from within the environment the engine needs (the host
    inherits it, and this process's stdout and stderr). ``factory``: a module-level
    callable that makes the ``LLM`` from ``llm_kwargs`` in the host (default: ``vllm.LLM``)."""

    def __init__(self, llm_kwargs: dict[str, Any], factory: Callable[..., Any] | None = None):
        from mcore_rl.process_title import titled

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.proc = context.Process(  # named whatever its environment went through (`titled`)
            target=titled, args=(PROCESS_TITLE, serve, child, llm_kwargs, factory or _vllm_llm),
            daemon=True, name=PROCESS_TITLE)
        self.proc.start()
        child.close()
        self._receive("starting the engine")

    def call(self, fn: Callable, *args):
        try:
            self._conn.send((fn, args))
        except (OSError, ValueError) as err:
            self._lost(fn.__name__, err)
        return self._receive(fn.__name__)

    def _receive(self, what: str):
        try:
            message = self._conn.recv_bytes()
        except (EOFError, OSError) as err:
            self._lost(what, err)
        try:
            status, value = pickle.loads(message)
        except Exception as err:  # noqa: BLE001 - e.g. an exception class that does not unpickle
            raise EngineHostError(f"the engine host's answer to {what} could not be read "
                                  f"here ({type(err).__name__}: {err})") from err
        if status == "ok":
            return value
        if isinstance(value, BaseException):
            raise value
        raise EngineHostError(value)

    def _lost(self, what: str, err: Exception):
        self.proc.join(timeout=2.0)  # its exit status is a moment behind the closed pipe
        how = (f"exit code {self.proc.exitcode}" if self.proc.exitcode is not None
               else "still running")
        raise EngineHostError(f"the engine host (pid {self.proc.pid}) closed its connection "
                              f"during {what} ({how})") from err

    def shutdown(self, kill_processes: Callable[[], None]) -> None:
        self._conn.close()
        kill_processes()
        self.proc.join(timeout=5.0)


def _reply(conn, status: str, value) -> None:
    try:
        message = pickle.dumps((status, value))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: send its text
        message = pickle.dumps(("error", f"{type(value).__name__}: {value}"))
    conn.send_bytes(message)


def _vllm_llm(**llm_kwargs):
    return vllm_shim.require().LLM(**llm_kwargs)


def serve(conn, llm_kwargs: dict[str, Any], factory: Callable[..., Any]) -> None:
    """The host's loop: make the ``LLM``, then run each ``(fn, args)`` received as
    ``fn(llm, *args)`` and answer ``("ok", result)`` or ``("error", exception)``; return
    when the connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner ends the run; the host follows
    try:
        llm = factory(**llm_kwargs)
    except BaseException:  # noqa: BLE001 - reported to the owner, which raises it
        _reply(conn, "error", f"the vLLM engine did not start:\n{traceback.format_exc()}")
        return
    _reply(conn, "ok", None)
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = fn(llm, *args)
        except BaseException as err:  # noqa: BLE001 - handed to the owner
            _reply(conn, "error", err)
        else:
            _reply(conn, "ok", result)
