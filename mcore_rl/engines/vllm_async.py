"""`AsyncHost`: a `VLLMEngine` on vLLM's ``AsyncLLM`` (the ``colocated`` and ``separate``
placements; ``fused`` keeps the blocking ``LLM`` of `mcore_rl.engines.vllm_host`).

``AsyncLLM`` runs vLLM's own loop in its engine-core process: every request is scheduled by
vLLM's continuous batching as soon as it arrives, and each one streams its tokens back on
its own, with no Python loop of ours stepping the engine. Weight updates are bracketed by
``pause_generation`` / ``resume_generation`` (`VLLMEngine.begin_update`): with ``keep`` the
requests in flight are frozen (their KV cache dropped, ``clear_cache``) and go on under
the new weights once ``finish_weight_update`` has recorded the new version; vLLM reports
the version of each span of their tokens.

The ``AsyncLLM`` client lives on an event loop of its own (a daemon thread of this
process). `SyncFacade` gives it the blocking ``LLM``'s methods, so the calls of
`mcore_rl.engines.vllm_host` run unchanged on either, and requests submitted one by one
(``llm_engine.add_request`` / ``abort_request``, and `SyncFacade.streamed` for a step)
are gathered here from vLLM's deltas as they stream, and reported once a sample finishes:
no Python loop steps the engine, and no sample's tokens are copied per token.

On CPU at engine TP1 the engine core runs its worker in itself (vLLM's ``uni`` executor:
the core is a fresh process, so its OpenMP settings take), which is one process, as the
blocking engine's host is.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any, Callable

from mcore_rl.engines import vllm_shim

STEP_WAIT_S = 0.05
"""How long ``step`` waits for any request to report before it returns nothing (the caller
holds the engine's lock meanwhile, which a weight sync waits for)."""


STREAM_INTERVAL = 16
"""A running request's tokens come to this process every this many tokens (and when it
finishes): each report costs Python time per request, beside the engine's own loop."""


class SyncFacade:
    """The blocking ``LLM``'s methods, on an ``AsyncLLM`` driven from another thread."""

    def __init__(self, host: "AsyncHost", llm):
        self._host, self.llm = host, llm
        self.stream_interval = STREAM_INTERVAL
        """Tokens between two reports of a running request (it reports when it finishes too)."""
        self.llm_engine = self  # requests one by one, as on ``LLM.llm_engine``
        self._latest: dict[str, dict[int, _Sample]] = {}
        """Request id -> its samples, for the requests that `streamed` has yet to report."""
        self._running: dict[str, asyncio.Task] = {}
        self._progress: dict[str, dict[int, _Sample]] = {}
        self._failed: dict[str, BaseException] = {}
        self._changed = threading.Event()
        self._ids = itertools.count()

    @property
    def vllm_config(self):
        return self.llm.vllm_config

    def _run(self, coro):
        return self._host.run(coro)

    # ----- generation -----------------------------------------------------------------
    def generate(self, inputs: list[dict], params: list, use_tqdm: bool = False) -> list:
        batch = next(self._ids)

        from vllm.sampling_params import RequestOutputKind

        async def one(i: int, prompt: dict, p):
            p.output_kind = RequestOutputKind.FINAL_ONLY
            # with n > 1 an output may carry only some samples: keep each one's last
            final, samples = None, {}
            async for out in self.llm.generate(prompt, p, request_id=f"generate-{batch}-{i}"):
                final = out
                samples.update((c.index, c) for c in out.outputs)
            final.outputs = [samples[j] for j in sorted(samples)]
            return final

        async def every():
            return await asyncio.gather(*(one(i, x, p) for i, (x, p) in
                                          enumerate(zip(inputs, params))))

        return list(self._run(every()))

    def add_request(self, request_id: str, prompt: dict, params) -> None:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA  # new tokens only: gathered here
        params.stream_interval = self.stream_interval
        samples: dict[int, _Sample] = {}

        async def stream():
            try:
                async for out in self.llm.generate(prompt, params, request_id=request_id):
                    finished = False
                    for c in out.outputs:
                        sample = samples.setdefault(c.index, _Sample(c.index))
                        finished |= sample.add(c)
                    if finished:  # reported to the next step; running samples are not
                        self._latest[request_id] = samples
                        self._changed.set()
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # noqa: BLE001 - raised by the next step
                self._failed.setdefault(request_id, err)
            finally:
                self._latest[request_id] = samples
                self._running.pop(request_id, None)
                self._changed.set()

        async def start():
            self._progress[request_id] = samples
            self._running[request_id] = asyncio.get_running_loop().create_task(stream())

        self._run(start())

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._latest)

    def tokens_so_far(self) -> dict[str, list[int]]:
        """Per request in flight, the tokens each of its samples has generated so far."""
        return {rid: [len(s.token_ids) for s in samples.values()]
                for rid, samples in list(self._progress.items())}

    def streamed(self) -> list:
        """`mcore_rl.engines.vllm_host.step` on ``AsyncLLM``: the requests in which a sample
        finished since the last call, each with its samples so far (``Completion``), after
        waiting at most `STEP_WAIT_S` for one."""
        if not self._latest:
            self._changed.wait(STEP_WAIT_S)
        self._changed.clear()
        if self._failed:
            request_id, err = next(iter(self._failed.items()))
            self._failed.clear()
            raise RuntimeError(f"request {request_id} failed in vLLM's engine: "
                               f"{type(err).__name__}: {err}") from err
        return self._run(self._take())

    async def _take(self) -> list:
        taken, self._latest = self._latest, {}
        for request_id in taken:
            if request_id not in self._running:
                self._progress.pop(request_id, None)
        return [(rid, [s.completion() for s in samples.values()])
                for rid, samples in taken.items()]

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort them; their final outputs (what they had, finish reason "abort") are what
        the next `step` returns for them."""
        async def abort():
            await self.llm.abort(list(request_ids))
            tasks = [self._running[r] for r in request_ids if r in self._running]
            if tasks:
                await asyncio.wait(tasks, timeout=10.0)

        self._run(abort())

    # ----- the rest of the ``LLM`` calls mcore-rl makes ---------------------------------
    def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self._run(self.llm.pause_generation(mode=mode, clear_cache=clear_cache))

    def resume_generation(self) -> None:
        self._run(self.llm.resume_generation())

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self._run(self.llm.collective_rpc(method, args=args))

    def init_weight_transfer_engine(self, request: dict) -> None:
        self._run(self.llm.collective_rpc("init_weight_transfer_engine",
                                          kwargs={"init_info": request["init_info"]}))

    def start_weight_update(self) -> None:
        self._run(self.llm.start_weight_update())

    def update_weights(self, request: dict) -> None:
        self._run(self.llm.collective_rpc("update_weights",
                                          kwargs={"update_info": request["update_info"]}))

    def finish_weight_update(self) -> None:
        self._run(self.llm.finish_weight_update())

    def shutdown_weight_transfer_engine(self) -> None:
        self._run(self.llm.shutdown_weight_transfer_engine())

    def update_weight_version(self, version: str) -> None:
        self._run(self.llm.update_weight_version(version))

    def get_weight_version(self) -> str:
        return self._run(self.llm.get_weight_version())

    def reset_prefix_cache(self) -> bool:
        return self._run(self.llm.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        self._run(self.llm.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._run(self.llm.wake_up(tags))


class _Sample:
    """One sample of a streamed request, gathered from vLLM's deltas."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.kept: list[tuple[int, ...]] | None = None
        self.finish_reason: str | None = None
        self.spans = None

    def add(self, c) -> bool:
        """Take a delta; whether it finished the sample."""
        self.token_ids += c.token_ids
        self.logprobs += [step[tok].logprob for step, tok in zip(c.logprobs or [], c.token_ids)]
        mask = getattr(c, "sampling_mask", None)
        if mask is not None:
            self.kept = (self.kept or []) + [tuple(ids) for ids in mask.token_ids]
        if getattr(c, "weight_versions", None) is not None:
            self.spans = tuple((str(v.version), v.start, v.end) for v in c.weight_versions)
        if c.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = c.finish_reason
            return True
        return False

    def completion(self):
        from mcore_rl.engines.vllm_host import Completion

        return Completion(self.index, tuple(self.token_ids), tuple(self.logprobs),
                          self.finish_reason, self.spans,
                          None if self.kept is None else tuple(self.kept))


class AsyncHost:
    """vLLM's ``AsyncLLM`` in this process, its engine core in a process of vLLM's; `call`
    runs a `mcore_rl.engines.vllm_host` call on its `SyncFacade`."""

    def __init__(self, llm_kwargs: dict[str, Any]):
        vllm_shim.require()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="vllm-async-llm")
        self._thread.start()

        async def make():  # on the loop, so that its output handler runs there
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**llm_kwargs))

        try:
            self.facade = SyncFacade(self, self.run(make()))
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro):
        """Run ``coro`` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def call(self, fn: Callable, *args):
        return fn(self.facade, *args)

    def shutdown(self, kill_processes: Callable[[], None]) -> None:
        from mcore_rl.engines.vllm_host import _quiet_engine_monitor

        llm = self.facade.llm
        _quiet_engine_monitor(llm.engine_core)
        kill_processes()

        async def down():
            for task in list(self.facade._running.values()):
                task.cancel()
            llm.shutdown()

        try:
            self.run(down())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
