"""Named registries of variants: advantage estimators, policy losses, rewards, engines,
prompt sources, weight-sync transports.

An entry is a name, the object, and metadata for facts that belong to the entry (an
estimator that needs a critic). Aliases are registered once, with the entry. A name can be
registered as *refused*: known, documented, and rejected with one line saying why (a
feature that is not available yet). Users plug in their own with a dotted path
``package.module:attr`` wherever a name is accepted; such an object's metadata is its
``registry_meta`` attribute (a dict), if any.
"""
from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from mcore_rl.errors import UsageError

T = TypeVar("T")


def import_by_path(path: str) -> Any:
    """``package.module:attr`` -> the object; one-line `UsageError` when it cannot be found."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise UsageError(f"'{path}' is not of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"cannot import module '{module_name}' for '{path}': {err}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"module '{module_name}' has no attribute '{attr}' (from '{path}')") from None


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered variant."""

    name: str
    """The canonical name (an alias resolves to it)."""
    obj: T
    meta: dict = field(default_factory=dict)


class Registry(Generic[T]):
    """name -> `Entry`, with a clear error listing what exists."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}
        self._refused: dict[str, str] = {}

    def register(self, name: str, *, aliases: tuple[str, ...] = (), **meta) -> Callable[[T], T]:
        """Decorator: register ``obj`` as ``name`` (and ``aliases``) with ``meta``."""
        def decorate(obj: T) -> T:
            for n in (name, *aliases):
                if n in self._entries or n in self._aliases or n in self._refused:
                    raise ValueError(f"{self.kind} '{n}' is registered twice")
            self._entries[name] = Entry(name, obj, dict(meta))
            self._aliases.update({alias: name for alias in aliases})
            return obj
        return decorate

    def refuse(self, name: str, reason: str) -> None:
        """Register ``name`` as known but not usable: `get` raises one line with ``reason``."""
        if name in self._entries or name in self._aliases or name in self._refused:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._refused[name] = reason

    def entry(self, name: str) -> Entry[T]:
        """The entry of a registered name or alias, or of a user object ``module:attr``."""
        name = self._aliases.get(name, name)
        if name in self._entries:
            return self._entries[name]
        if name in self._refused:
            raise UsageError(f"{self.kind} '{name}' is not available: {self._refused[name]}")
        if ":" in name:
            obj = import_by_path(name)
            return Entry(name, obj, dict(getattr(obj, "registry_meta", {}) or {}))
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UsageError(f"unknown {self.kind} '{name}'{hint} (registered: "
                         f"{', '.join(self.names())}; or give module:attr)")

    def get(self, name: str) -> T:
        """The object of a registered name or alias, or a user object given as ``module:attr``."""
        return self.entry(name).obj

    def meta(self, name: str, key: str, default: Any = None) -> Any:
        """One metadata fact of an entry (``default`` when it does not state it)."""
        return self.entry(name).meta.get(key, default)

    def names(self) -> list[str]:
        """Registered canonical names (not aliases, not refused names)."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._entries
