"""The single place that imports Triton.

Everything else asks this module whether Triton is there (``HAS_TRITON``) and calls
``require_triton()`` before importing a module that defines ``@triton.jit`` kernels, so that
a machine without Triton (or with a broken install) still has the torch paths.
"""
from __future__ import annotations

import os

import torch

try:  # any failure here (missing package, broken driver stubs) means "no Triton"
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _IMPORT_ERROR: BaseException | None = None
except Exception as exc:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False
    _IMPORT_ERROR = exc

__all__ = ["HAS_TRITON", "triton", "tl", "require_triton", "interpret_mode", "check_launchable", "triton_usable_for"]


def require_triton() -> None:
    """Raise a clear error when a Triton path was requested but Triton cannot be imported."""
    if not HAS_TRITON:
        raise ImportError(
            "impl='triton' needs the triton package (pip install 'mcore-rl[triton]'); "
            f"importing it failed with: {_IMPORT_ERROR!r}"
        )


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def check_launchable(*tensors: torch.Tensor) -> None:
    """Triton kernels need GPU tensors, except under the interpreter, which runs on CPU tensors."""
    require_triton()
    if interpret_mode():
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                "impl='triton' needs CUDA tensors (got a tensor on "
                f"{t.device}); use impl='cpu' or set TRITON_INTERPRET=1 to debug kernels on CPU"
            )


def triton_usable_for(t: torch.Tensor) -> bool:
    """Whether impl='auto' may pick Triton for this tensor: only real GPU launches, never CPU."""
    return HAS_TRITON and t.is_cuda
