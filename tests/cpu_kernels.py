"""One CPU code path for every x86 machine the suite runs on.

PyTorch, MKL and oneDNN each pick their kernels by the CPU they find (AVX-512 on one machine,
AVX2 on another), and the kernels sum in different orders. The golden runs replay recorded
metrics to round-off over a warm start and sampled rollouts, where a difference in the last
bit grows into different tokens, so they hold on one machine type only unless every
process computes on the same path. These variables pin that path to AVX2, which every x86
machine the suite runs on has, with MKL's conditional numerical reproducibility.

They must be set before torch is imported, in the process that starts the suite: ranks,
Ray workers, engines and ``mcore-rl`` subprocesses inherit them. A value already set in the
environment wins.
"""
from __future__ import annotations

import os
import platform
import sys

PINNED = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pin_cpu_kernels() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    if "torch" in sys.modules:
        raise RuntimeError("pin_cpu_kernels() must run before torch is imported")
    for name, value in PINNED.items():
        os.environ.setdefault(name, value)
