"""Named registries of variants (advantage estimators, losses, rewards, engines).

Users plug in their own with a dotted path ``package.module:function`` wherever a name is
accepted.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Callable, Generic, TypeVar

from mcore_rl.errors import UsageError

T = TypeVar("T")


def import_by_path(path: str) -> Callable:
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


class Registry(Generic[T]):
    """name -> implementation, with a clear error listing what exists."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = obj
            return obj
        return decorate

    def get(self, name: str) -> T:
        """A registered name, or a user object given as ``module:attr``."""
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return import_by_path(name)  # type: ignore[return-value]
        close = difflib.get_close_matches(name, list(self._items), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UsageError(f"unknown {self.kind} '{name}'{hint} (registered: "
                         f"{', '.join(sorted(self._items))}; or give module:function)")

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
