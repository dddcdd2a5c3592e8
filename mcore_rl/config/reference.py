"""The config reference: every section and field of `RLConfig` with its type, default and
docstring, as Markdown (the docs site's config page is generated from it, so it cannot
drift from the code)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from mcore_rl.config import sections
from mcore_rl.config.loader import _type_name


def field_docs(cls) -> dict[str, str]:
    """``field -> docstring`` of a config dataclass (the string literal under each field)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(cls, path: str, level: int) -> list[str]:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    out = [f"{'#' * level} `{path}`", "", _cell(inspect.cleandoc(cls.__doc__ or "")), "",
           "| field | type | default | what it does |", "|---|---|---|---|"]
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.append((tp, f"{path}.{f.name}"))
            continue
        default = _default(f)
        shown = "" if default is None else f"`{default!r}`" if default != "" else '`""`'
        out.append(f"| `{f.name}` | {_cell(_type_name(tp))} | {shown} | {_cell(docs.get(f.name, ''))} |")
    out.append("")
    for tp, sub in nested:
        out += _section(tp, sub, level + 1)
    return out


def config_reference_markdown() -> str:
    """Every section of `RLConfig` as a Markdown table of its fields."""
    hints = typing.get_type_hints(sections.RLConfig)
    out = []
    for f in dataclasses.fields(sections.RLConfig):
        out += _section(hints[f.name], f.name, 2)
    return "\n".join(out)
