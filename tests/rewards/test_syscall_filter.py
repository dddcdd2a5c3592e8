"""The seccomp filter's system call numbers are the kernel's, per architecture: a wrong one
would leave a call open, or refuse one a program needs."""
import re
from pathlib import Path

import pytest

from mcore_rl.rewards.sandbox.syscall_filter import _NAMES, _NUMBERS, program

HEADERS = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
           "aarch64": Path("/usr/include/asm-generic/unistd.h")}


@pytest.mark.parametrize("machine", sorted(_NUMBERS))
def test_the_numbers_are_the_kernel_headers_ones(machine):
    header = HEADERS[machine]
    if not header.is_file():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b",
                                                    header.read_text())}
    assert set(_NUMBERS[machine]) == set(_NAMES)
    assert {n: defined.get(n) for n in _NAMES} == _NUMBERS[machine]


@pytest.mark.parametrize("machine", sorted(_NUMBERS))
def test_the_program_checks_the_abi_then_denies_each_number_once(machine):
    code = program(machine)
    assert code[0] == (0x20, 0, 0, 4) and code[-1] == (0x06, 0, 0, 0x7FFF0000)  # arch; allow
    denied = [k for op, _, _, k in code if op == 0x15][1:]  # after the architecture's check
    assert sorted(denied) == sorted(set(_NUMBERS[machine].values()))
    assert len(code) < 4096  # the kernel's limit on a filter's length
