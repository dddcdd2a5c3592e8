"""The one place mcore-rl imports Ray from (an optional dependency of `mcore_rl.flow`)."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import signal
from typing import Any, Callable

from mcore_rl.config.sections import LaunchConfig
from mcore_rl.errors import UsageError


def available() -> bool:
    """Whether Ray can be imported (checked without importing it)."""
    return importlib.util.find_spec("ray") is not None


def require() -> Any:
    """The ``ray`` module, or a one-line `UsageError` saying how to install it."""
    if not available():
        raise UsageError("mcore_rl.flow runs controllers on Ray, which is not installed: "
                         "pip install ray (on CPU: bash scripts/install.sh)")
    import ray

    return ray


DRIVER_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Signals whose handlers ``ray.init`` replaces in the driver, and never puts back."""


REACH_TIMEOUT_S = 5.0
"""How long joining a Ray cluster may wait for its head's port to answer."""


def _check_reachable(address: str | None) -> None:
    """A `UsageError` when ``address`` (host:port of a Ray head) does not answer: Ray itself
    would retry a dead address for minutes."""
    import socket

    if not address or address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=REACH_TIMEOUT_S).close()
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot join the Ray cluster at {address} (RAY_ADDRESS or the address "
                         f"given): {err}; start its head there, or unset RAY_ADDRESS to run on a "
                         "Ray of this machine") from None


RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
"""Ray's setting of how long its processes retry a GCS that is gone (read from the
environment of each process when it starts)."""


def start_local(reconnect_timeout_s: int = LaunchConfig.ray_reconnect_timeout_s,
                **init_kwargs) -> Callable[[], None]:
    """``ray.init(**init_kwargs)``; returns the function that shuts it down again and puts
    back the driver's signal handlers as they were before (the trainer's own stop
    handling, a caller's handlers). ``reconnect_timeout_s``: `RECONNECT_ENV`, for this
    process and the Ray processes it starts (unless the environment sets it already)."""
    ray = require()
    _check_reachable(init_kwargs.get("address") or os.environ.get("RAY_ADDRESS"))
    os.environ.setdefault(RECONNECT_ENV, str(reconnect_timeout_s))
    saved = {sig: signal.getsignal(sig) for sig in DRIVER_SIGNALS}
    try:
        ray.init(**init_kwargs)
    except Exception as err:  # noqa: BLE001 - Ray raises several kinds; one line for each
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        address = init_kwargs.get("address") or os.environ.get("RAY_ADDRESS")
        if address:
            raise UsageError(f"cannot join the Ray cluster at {address} (RAY_ADDRESS or the "
                             f"address given): {why}; start it there, or unset RAY_ADDRESS to "
                             "run on a Ray of this machine") from None
        raise UsageError(f"Ray did not start on this machine: {why}") from None

    def stop() -> None:
        ray.shutdown()
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    return stop


@contextlib.contextmanager
def local_ray(**init_kwargs):
    """Ray started for the span of the block (`start_local`), then shut down."""
    stop = start_local(**init_kwargs)
    try:
        yield require()
    finally:
        stop()


@functools.lru_cache(maxsize=None)
def actor_class(cls: type) -> Any:
    """``cls`` as a Ray actor class (made once per class; options are given per actor)."""
    return require().remote(cls)


def ray_node() -> Any:
    """Ray's record of the node this process is connected to (its session, addresses and,
    when this process started it, its processes), or None."""
    return getattr(require()._private.worker, "_global_node", None)  # noqa: SLF001 - only here


def session_dir() -> str | None:
    """The directory of the Ray session this process is connected to (its ``logs/`` hold
    every Ray process's output), or None."""
    node = ray_node()
    return node.get_session_dir_path() if node is not None else None


def node_id() -> str:
    """The Ray node this process runs on."""
    return require().get_runtime_context().get_node_id()


def on_node(node: str | None) -> dict:
    """Actor options that put an actor on the node with id ``node`` (none for None)."""
    if node is None:
        return {}
    require()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


def get_all(refs: list, poll_s: float = 0.5) -> list:
    """``ray.get`` of several references that raises as soon as any of them failed (plain
    ``ray.get`` of a list may first wait for an earlier one that never finishes)."""
    ray = require()
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=poll_s, fetch_local=False)
        for ref in ready:
            ray.get(ref)
    return ray.get(refs)
