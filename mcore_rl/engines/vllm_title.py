"""vLLM's engine core named as vLLM names it, whatever its environment went through: a
``vllm.general_plugins`` entry point (``setup.py``), which every vLLM process loads as it
starts.

vLLM titles its processes (``VLLM::EngineCore``) through setproctitle, which misses in a
spawned process whose first environment variable was set again before (Ray's worker
module, vLLM's own ``env_override``, torch and OpenCV each set some as they are imported;
`mcore_rl.process_title`). The process then shows in ``ps`` as ``python -B -c from
multiprocessing.spawn ...``. An engine core loads the plugins after vLLM's own title:
where that did not take, `title_process` writes the title vLLM meant
(``VLLM::EngineCore``, ``VLLM::EngineCore_DP<n>`` for a data-parallel rank other than 0)
through `mcore_rl.process_title`.

Every other process is left alone: a worker of vLLM's multi-process executor loads the
plugins before its own title is set (a name written first would cut setproctitle's
later one short), and the trainer's process loads them when it builds an engine in-process.
`mcore_rl.engines.vllm_engine` finds an engine's processes titled or not.
"""
from __future__ import annotations

import multiprocessing
import re

from mcore_rl.engines.liveness import untitled_spawn
from mcore_rl.process_title import set_title

ENGINE_CORE = re.compile(r"EngineCore(?:_DP(\d+))?$")
"""vLLM's name for an engine-core process (``multiprocessing`` process name)."""


def intended_title(process_name: str, prefix: str = "VLLM") -> str | None:
    """The title vLLM gives the engine core it started as ``process_name``, or None for
    any other process."""
    core = ENGINE_CORE.match(process_name)
    if core is None:
        return None
    rank = core.group(1)
    return f"{prefix}::EngineCore" + (f"_DP{rank}" if rank not in (None, "0") else "")


def title_process() -> None:
    """The plugin: name an engine core as vLLM meant to, where vLLM's own title is missing.
    A name is no reason for an engine to fail: any error leaves the process as it was."""
    try:
        import psutil
        from vllm import envs

        title = intended_title(multiprocessing.current_process().name,
                               envs.VLLM_PROCESS_NAME_PREFIX)
        if title is not None and untitled_spawn(psutil.Process().cmdline()):
            set_title(title)
    except Exception:  # noqa: BLE001 - vLLM's plugin loader would end the engine with it
        pass
