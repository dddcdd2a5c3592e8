"""The seccomp filter's system call numbers are the kernel's, per architecture: a wrong one
would leave a call open, or refuse one a program needs."""
import re
from pathlib import Path

import pytest

from mcore_rl.rewards.sandbox.syscall_filter import _NAMES, _NUMBERS, _ONLY, _SOCKETS, program

HEADERS = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
           "aarch64": Path("/usr/include/asm-generic/unistd.h")}


@pytest.mark.parametrize("machine", sorted(_NUMBERS))
def test_the_numbers_are_the_kernel_headers_ones(machine):
    header = HEADERS[machine]
    if not header.is_file():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b",
                                                    header.read_text())}
    names = _NAMES + _ONLY[machine]
    assert list(_NUMBERS[machine]) == list(names)
    assert {n: defined.get(n) for n in names} == _NUMBERS[machine]
    assert _SOCKETS[machine] == (defined["socket"], defined["socketpair"])


@pytest.mark.parametrize("machine", sorted(_NUMBERS))
def test_the_program_checks_the_abi_then_sockets_then_denies_each_number_once(machine):
    code = program(machine)
    assert code[0] == (0x20, 0, 0, 4) and code[-1] == (0x06, 0, 0, 0x7FFF0000)  # arch; allow
    socket = code.index((0x15, 2, 0, _SOCKETS[machine][0]))
    denied = [k for op, _, _, k in code[socket + 12:] if op == 0x15]  # after the families
    assert sorted(denied) == sorted(set(_NUMBERS[machine].values()))
    assert len(code) < 4096  # the kernel's limit on a filter's length
    jumps = [(i, max(jt, jf, k if op == 0x05 else 0)) for i, (op, jt, jf, k) in enumerate(code)
             if op & 0x07 == 0x05]
    assert all(i + 1 + offset < len(code) for i, offset in jumps)  # each lands in the program
