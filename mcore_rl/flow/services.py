"""Objects a controller offers to the others by name: e.g. a rollout controller publishes
its engine, and the trainer controller's weight sync streams new weights into it.

    # in the rollout controller's function (built in its process)
    self.engine = build_rollout_engine(...)
    self.lock = publish("engine/0", self.engine)   # hold it while using the engine yourself

    # in the trainer controller's function
    engine = lookup("engine/0")   # a proxy: engine.load_bucket(...) runs in the owner's process

A call through the proxy runs in the publishing process, on a thread of its own, under the
lock `publish` returned, so it never interleaves with the owner's own use of the object
(a generation in flight finishes first). Attributes that are not methods are read the
same way, each time afresh. A publisher that dies fails the call (Ray's `RayActorError`),
and the launch names the controller that depended on it.

An object published in the caller's own process (roles fused into one process: the
``fused`` placement) is looked up as a `Local` proxy: the same calls, under the same lock,
without Ray; such a name needs no hub at all."""
from __future__ import annotations

import threading
import time
from typing import Any

from mcore_rl.errors import UsageError
from mcore_rl.flow import ray_shim, round_trips

LOOKUP_TIMEOUT_S = 600.0
"""How long `lookup` waits for a name to be published (controllers start in parallel;
building an engine can take minutes on a large model)."""

_hub: Any = None
_published: dict[str, tuple[Any, threading.RLock]] = {}


def set_hub(hub: Any) -> None:
    """The launch's hub, for this process (set by the runtime when it starts an actor)."""
    global _hub
    _hub = hub


def current_hub() -> Any:
    return _hub


def _require_hub() -> Any:
    if _hub is None:
        raise UsageError("publish/lookup work inside controllers of a launch (mcore_rl.flow.launch)")
    return _hub


def publish(name: str, obj: Any) -> threading.RLock:
    """Offer ``obj`` to the other controllers of the launch as ``name``; the lock that every
    call through a proxy holds (hold it too while using ``obj`` in this process). Without
    a hub (roles fused into one process outside Ray) only this process can look it up."""
    lock = threading.RLock()
    _published[name] = (obj, lock)
    if _hub is not None:
        ray = ray_shim.require()
        me = ray.get_runtime_context().current_actor
        ray.get(_hub.publish.remote(name, [me]))
    return lock


def unpublish_all() -> None:
    """Forget what this process published (its launch ended; a process that serves several
    launches in turn, a test's world, publishes the same names again)."""
    _published.clear()


def lookup(name: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> "Remote | Local":
    """A proxy for the object published as ``name``, once it is (waits up to ``timeout_s``):
    a `Local` one when this process published it."""
    if name in _published:
        return Local(name, *_published[name])
    ray = ray_shim.require()
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        boxed = ray.get(_require_hub().lookup.remote(name))
        if boxed is not None:
            remote = Remote(name, boxed[0])
            remote._methods.update(remote._get(METHODS, None, None))  # once, not per call
            return remote
        if time.monotonic() > deadline:
            raise UsageError(f"no controller published an object named '{name}' within "
                             f"{timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def finish_launch() -> None:
    """End the launch from inside a controller once its work is done (e.g. a trainer that
    took its last step while the data still holds items): every stream is cancelled, each
    controller finishes the call it is in and closes, and the launch returns its stats.
    Without a hub (fused roles outside Ray) the caller's own loop ends at its next item."""
    global _finished
    _finished = True
    if _hub is not None:
        ray = ray_shim.require()
        ray.get(_hub.cancel.remote())


_finished = False


def take_finished() -> bool:
    """Whether `finish_launch` was called in this process since the last time this asked."""
    global _finished
    was, _finished = _finished, False
    return was


def serve(name: str, attr: str, args: tuple | None, kwargs: dict | None) -> Any:
    """In the publishing process: ``obj.attr(*args, **kwargs)``, or with ``args`` None the
    attribute itself (a method comes back as the marker `METHOD`)."""
    obj, lock = _published[name]
    if attr == METHODS:
        cls = type(obj)  # what its class defines (no property runs)
        return [a for a in dir(cls) if not a.startswith("_") and callable(getattr(cls, a))]
    with lock:
        value = getattr(obj, attr)
        if args is None:
            return METHOD if callable(value) else value
        return value(*args, **(kwargs or {}))


METHOD = "<method>"
METHODS = "<methods>"
"""The attribute a lookup asks for first: the names of the object's methods."""


class Remote:
    """A proxy for an object published by another process (see the module doc); every call
    is one Ray round trip (`mcore_rl.flow.round_trips`)."""

    def __init__(self, name: str, handle: Any):
        self._name, self._handle = name, handle
        self._methods: set[str] = set()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in self._methods:
            value = self._get(attr, None, None)
            if not (isinstance(value, str) and value == METHOD):
                return value
            self._methods.add(attr)
        return lambda *args, **kwargs: self._get(attr, args, kwargs)

    def _get(self, attr: str, args: tuple | None, kwargs: dict | None) -> Any:
        ray = ray_shim.require()
        round_trips.add()
        return ray.get(self._handle.serve.remote(self._name, attr, args, kwargs))

    def __repr__(self) -> str:
        return f"Remote({self._name!r})"

    def __reduce__(self):
        return (Remote, (self._name, self._handle))


class Local:
    """A proxy for an object published in this process: its calls run here, under its lock."""

    def __init__(self, name: str, obj: Any, lock: threading.RLock):
        self._name, self._obj, self._lock = name, obj, lock

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = getattr(self._obj, attr)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            with self._lock:
                return value(*args, **kwargs)

        return call

    def __repr__(self) -> str:
        return f"Local({self._name!r})"
