"""The one place mcore-rl imports SGLang from (an optional dependency; GPU only).

SGLang pins its own torch build and a CUDA kernel wheel, so it never installs beside the CPU
stack: its adapter (`mcore_rl.engines.sglang_engine`) is checked in CI against a manifest of
SGLang's parameters produced once with SGLang's own model code (``engines/data``).
"""
from __future__ import annotations

import importlib.util

from mcore_rl.errors import UsageError


def available() -> bool:
    """Whether SGLang can be imported (checked without importing it)."""
    return importlib.util.find_spec("sglang") is not None


def require():
    """The ``sglang`` module, or a one-line `UsageError` saying how to install it."""
    if not available():
        raise UsageError("rollout.engine=sglang needs SGLang, which is not installed: pip install "
                         "'sglang[all]' on a GPU machine (it does not run on CPU), or set "
                         "rollout.engine=vllm")
    import sglang

    return sglang


def weight_update_group(*, backend: str, init_method: str, world_size: int, rank: int,
                        group_name: str):
    """A process group with an SGLang engine's workers, made as SGLang makes its side of it
    (``init_weights_update_group``): the trainer's sending rank joins as ``rank`` 0."""
    require()
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:  # moved in later SGLang releases
        from sglang.srt.utils.common import init_custom_process_group
    return init_custom_process_group(backend=backend, init_method=init_method,
                                     world_size=world_size, rank=rank, group_name=group_name)
