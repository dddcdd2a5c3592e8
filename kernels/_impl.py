"""Choosing between the reference, the fast torch path and the Triton kernel of an op."""
from __future__ import annotations

import torch

from mcore_rl.kernels._triton import check_launchable, triton_usable_for

#: "reference": plain torch, written for clarity; "cpu": the fast torch path (chunked / scan
#: based, runs on any device and is what CPU users get); "triton": the GPU kernel;
#: "auto": Triton for CUDA tensors when it is installed, otherwise "cpu".
IMPLS = ("auto", "reference", "cpu", "triton")


def resolve_impl(impl: str, tensor: torch.Tensor) -> str:
    """Map ``impl`` to one of "reference", "cpu", "triton" for inputs living where ``tensor`` is."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if triton_usable_for(tensor) else "cpu"
    if impl == "triton":
        check_launchable(tensor)
    return impl
