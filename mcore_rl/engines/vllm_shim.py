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


def sampling_params(**kwargs):
    return require().SamplingParams(**kwargs)


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def add_streaming_request(llm, request_id: str, prompt_token_ids: list[int], params) -> None:
    """Add a request to ``llm``'s engine that reports its samples' tokens after every engine
    step (cumulative), for a caller that steps the engine itself (`LLMEngine.step`)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.CUMULATIVE
    engine_input = llm._preprocess_cmpl_one({"prompt_token_ids": list(prompt_token_ids)}, None)
    llm.llm_engine.add_request(request_id, engine_input, params)
