"""YAML -> `RLConfig`, with ``section.field=value`` overrides and type checking.

Every problem is a `ConfigError` whose message is one line naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from mcore_rl.config.sections import RLConfig
from mcore_rl.errors import ConfigError


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(options)}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"a mapping of {_type_name(key)} to {_type_name(value)}"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert where it is lossless."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is dict:
        return _coerce_mapping(value, tp, where)
    if origin is list:
        if isinstance(value, str):  # a=x,y on the command line, or one item
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected {_type_name(tp)} ([a, b] in YAML or an override), "
                              f"got {value!r} ({type(value).__name__})")
        item_type = typing.get_args(tp)[0]
        return [coerce(item, item_type, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, allowed))}, "
                              f"got {value!r}{_closest(str(value), [str(a) for a in allowed])}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _coerce_mapping(value: Any, tp: Any, where: str) -> dict:
    """A ``dict[K, V]`` field: each key and value checked as K and V, errors naming the key."""
    key_type, value_type = typing.get_args(tp)
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected {_type_name(tp)} (key: value lines in YAML), "
                          f"got {value!r} ({type(value).__name__})")
    out = {}
    for key, item in value.items():
        name = coerce(key, key_type, f"{where} key {key!r}")
        entry = f"{where}.{name}"
        if isinstance(item, dict) and typing.get_origin(value_type) is not dict:
            raise ConfigError(f"{entry}: expected {_type_name(value_type)}, got a mapping {item!r} "
                              "(an override splits keys at dots: a key with dots goes in the YAML file)")
        out[name] = coerce(item, value_type, entry)
    return out


RENAMED = {
    "logging.tensorboard": "TensorBoard is one of logging.backends; for no event files set "
                           "logging.backends=[jsonl] (the default is [jsonl, tensorboard])",
}
"""Keys an earlier release had: what replaces them."""


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls, data: Any, where: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            if path in RENAMED:
                raise ConfigError(f"'{path}' is gone: {RENAMED[path]}")
            raise ConfigError(f"unknown key '{path}'{_closest(str(key), names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, path)
        else:
            kwargs[key] = coerce(value, tp, path)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Merge ``section.field=value`` overrides into a raw YAML mapping (before typing)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; shipped configs are in configs/")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: "
                          f"{getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLConfig:
    """Read a YAML file (or defaults) and apply overrides into a typed `RLConfig`.

    Cross-field checks (layout vs model and world size) are in ``validate_config``; which
    job, schedule and placement go together in ``mcore_rl.roles.rules``.
    """
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides or [])
    return _build(RLConfig, data, "")


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> RLConfig:
    """The `RLConfig` of `config_to_dict`'s output (how a config travels to other processes)."""
    return _build(RLConfig, data, "")


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
