"""The one place mcore-rl imports vLLM from (an optional dependency)."""
from __future__ import annotations

import importlib.util

from mcore_rl.errors import UsageError

WORKER_EXTENSION = "mcore_rl.engines.vllm_worker.ReshardWorkerExtension"
"""Qualified name of the worker extension vLLM mixes into its workers."""


def available() -> bool:
    """Whether vLLM can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def require():
    """The ``vllm`` module, or a one-line `UsageError` saying how to install it."""
    if not available():
        raise UsageError("rollout.engine=vllm needs vLLM, which is not installed: pip install "
                         "vllm (on CPU: bash scripts/install.sh), or set rollout.engine=hf")
    import vllm

    return vllm


PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN = "mcore_rl_weight_transfer"
"""The entry point (``setup.py``) that registers `BACKEND` in each vLLM process."""
PLUGIN_TARGET = "mcore_rl.engines.vllm_transfer:register"
BACKEND = "mcore_rl_mapped"
"""mcore-rl's weight-transfer backend (`mcore_rl.engines.vllm_transfer.MappedFileEngine`)."""


def weight_transfer_backend() -> str:
    """The name of mcore-rl's weight-transfer backend, once it is sure that vLLM's worker
    processes will load it (the ``vllm.general_plugins`` entry point of ``setup.py``); a
    one-line `UsageError` otherwise, before an engine starts (vLLM itself would only log the
    failed plugin and then fail inside its worker)."""
    import os
    from importlib.metadata import entry_points

    target = PLUGIN_TARGET
    found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN]
    if not found or found[0].value != target:
        raise UsageError(f"vLLM's plugin {PLUGIN!r} ({PLUGIN_GROUP} entry point -> {target}) is "
                         "not installed, so vLLM's workers cannot receive mcore-rl's weight "
                         "syncs: reinstall mcore-rl (pip install -e . , or bash "
                         "scripts/install.sh)")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in [p.strip() for p in allowed.split(",")]:
        raise UsageError(f"VLLM_PLUGINS={allowed!r} leaves out vLLM's plugin {PLUGIN!r}, "
                         "so vLLM's workers cannot receive mcore-rl's weight syncs: add it "
                         f"(VLLM_PLUGINS={allowed + ',' if allowed else ''}{PLUGIN}) or unset "
                         "VLLM_PLUGINS")
    return BACKEND


def sampling_params(**kwargs):
    return require().SamplingParams(**kwargs)


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def add_streaming_request(llm, request_id: str, prompt_token_ids: list[int], params) -> None:
    """Add a request to ``llm``'s engine that reports its samples' tokens after every engine
    step (cumulative), for a caller that steps the engine itself (`LLMEngine.step`), or takes
    what ``AsyncLLM`` streamed (`mcore_rl.engines.vllm_async.SyncFacade`)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.CUMULATIVE
    prompt = {"prompt_token_ids": list(prompt_token_ids)}
    preprocess = getattr(llm, "_preprocess_cmpl_one", None)  # AsyncLLM does its own
    llm.llm_engine.add_request(request_id, prompt if preprocess is None else
                               preprocess(prompt, None), params)
