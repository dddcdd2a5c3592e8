"""One CPU code path for the suite, and the kind of CPU it runs on.

PyTorch, MKL and oneDNN each pick their kernels by the CPU they find (AVX-512 on one machine,
AVX2 on another), and the kernels sum in different orders. The golden runs replay recorded
metrics to round-off over a warm start and sampled rollouts, where a difference in the last
bit grows into different tokens (Adam's first steps move every weight by about the learning
rate whatever the size of its gradient, so a round-off sign flip is a full step). These
variables pin the path to AVX2, which every x86 machine the suite runs on has, with MKL's
conditional numerical reproducibility.

The pin narrows the differences but does not remove them: on a CPU with AVX-512 and AMX the
pinned runs still part from an AVX2-only machine's at about 1e-3 from the first step (MKL's
branch is one cause: each ``MKL_CBWR`` value gives other numbers; others remain). So golden
values are kept per CPU kind (``cpu_kind()``), as GPU projects keep theirs per GPU type.

The variables must be set before torch is imported, in the process that starts the suite:
ranks, Ray workers, engines and ``mcore-rl`` subprocesses inherit them. A value already set
in the environment wins.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

X86 = ("x86_64", "amd64")
"""What ``platform.machine()`` says (lower-cased) on an x86 machine."""
PINNED = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_kind() -> str:
    """The kind of CPU this machine has (see ``kind_of``)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return kind_of(platform.machine(), flags)


def kind_of(machine: str, flags: set[str]) -> str:
    """A kind of CPU by the vector instructions its kernels can use: ``x86-avx2``,
    ``x86-avx512``, ``x86-avx512-amx`` (``x86`` below AVX2), or the machine name off x86."""
    if machine.lower() not in X86:
        return machine.lower()
    if "avx512f" not in flags:
        return "x86-avx2" if "avx2" in flags else "x86"
    return "x86-avx512-amx" if "amx_tile" in flags else "x86-avx512"


def pin_cpu_kernels() -> None:
    if platform.machine().lower() not in X86:
        return
    if "torch" in sys.modules:
        raise RuntimeError("pin_cpu_kernels() must run before torch is imported")
    for name, value in PINNED.items():
        os.environ.setdefault(name, value)
