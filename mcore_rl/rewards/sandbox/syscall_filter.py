"""A seccomp filter for the sandboxed program: system calls that a scoring program has no
use for, and that only widen the kernel surface it can reach, fail with EPERM.

Namespaces and dropped capabilities already make most of them fail; the filter also closes
those an unprivileged process keeps: io_uring, perf events, BPF, userfaultfd, the kernel
keyrings, ptrace and process memory access, personality (which turns off address space
randomisation), fanotify, secret memory, the x86 LDT, and mount and namespace calls again
(a namespace made through ``clone`` is refused by the sandbox's user-namespace limit).
Sockets are limited to the Unix, IP and netlink-routing families. Calls through another
ABI (32-bit ``int 0x80``, x32 on x86-64), whose numbers differ, fail the same way.

A raw BPF program installed with ``prctl(PR_SET_SECCOMP)`` (no_new_privs must be set),
standard library only: this module is loaded by `namespace_init`, which runs as
``python -I -S``. On an architecture not listed here no filter is installed
(`install` returns False).
"""
from __future__ import annotations

import ctypes
import os
import platform

_NAMES = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
          "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "keyctl", "add_key", "request_key", "personality",
          "fanotify_init", "memfd_secret",
          "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns",
          "name_to_handle_at", "open_by_handle_at", "kexec_load", "kexec_file_load",
          "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot",
          "acct", "quotactl", "quotactl_fd", "lookup_dcookie", "syslog", "vhangup",
          "settimeofday", "clock_settime", "adjtimex", "clock_adjtime")
"""The denied calls, by name, on every architecture (`_ONLY` adds some of one)."""

_ONLY = {"x86_64": ("modify_ldt", "uselib"), "aarch64": ()}

_NUMBERS = {
    "x86_64": dict(zip(_NAMES + _ONLY["x86_64"], (
        101, 310, 311, 312, 438, 321, 298, 323, 425, 426, 427, 250, 248, 249, 135, 300, 447,
        165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442, 272, 308, 303, 304, 246, 320,
        175, 313, 176, 167, 168, 169, 163, 179, 443, 212, 103, 153, 164, 227, 159, 305,
        154, 134))),
    "aarch64": dict(zip(_NAMES, (
        117, 270, 271, 272, 438, 280, 241, 282, 425, 426, 427, 219, 217, 218, 92, 262, 447,
        40, 39, 41, 51, 428, 429, 430, 431, 432, 433, 442, 97, 268, 264, 265, 104, 294,
        105, 273, 106, 224, 225, 142, 89, 60, 443, 18, 116, 58, 170, 112, 171, 266))),
}
"""Their numbers per architecture (the kernel's syscall tables)."""

_SOCKETS = {"x86_64": (41, 53), "aarch64": (198, 199)}
"""socket and socketpair: only the address families a program may use pass (`program`)."""
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, NETLINK_ROUTE = 1, 2, 10, 16, 0

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000

_LD_W_ABS, _JA, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x05, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_ERRNO, _EPERM, _EAFNOSUPPORT = 0x7FFF0000, 0x00050000, 1, 97
_NR, _ARCH, _ARG0, _ARG2 = 0, 4, 16, 32  # offsets in struct seccomp_data (little-endian)
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF instructions (code, jt, jf, k) for ``machine``: another ABI's call or a
    denied number returns EPERM; a socket of another family than Unix, IPv4, IPv6 or
    netlink's routing (what ``getaddrinfo`` uses) returns EAFNOSUPPORT (families such as
    vsock, TIPC or RDS, whose modules a distribution kernel loads on demand, stay out of
    reach); anything else is allowed."""
    allow, deny = (_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)
    code = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, _AUDIT_ARCH[machine]), deny,
            (_LD_W_ABS, 0, 0, _NR)]
    if machine == "x86_64":
        code += [(_JGE_K, 0, 1, _X32_BIT), deny]
    socket, socketpair = _SOCKETS[machine]
    families = [  # returns; the syscall number is left in place when skipped
        (_LD_W_ABS, 0, 0, _ARG0),
        (_JEQ_K, 5, 0, AF_UNIX), (_JEQ_K, 4, 0, AF_INET), (_JEQ_K, 3, 0, AF_INET6),
        (_JEQ_K, 0, 3, AF_NETLINK),
        (_LD_W_ABS, 0, 0, _ARG2), (_JEQ_K, 0, 1, NETLINK_ROUTE),
        allow, (_RET_K, 0, 0, _RET_ERRNO | _EAFNOSUPPORT)]
    code += [(_JEQ_K, 2, 0, socket), (_JEQ_K, 1, 0, socketpair), (_JA, 0, 0, len(families)),
             *families]
    for number in sorted(set(_NUMBERS[machine].values())):
        code += [(_JEQ_K, 0, 1, number), deny]
    return code + [allow]


def install() -> bool:
    """Install the filter on this process (and what it starts); False where no table is
    known for this architecture. Raises `OSError` if the kernel refuses it."""
    machine = platform.machine()
    if machine not in _NUMBERS:
        return False
    code = program(machine)
    instructions = (_Instruction * len(code))(*(_Instruction(*i) for i in code))
    prog = _Program(len(code), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(ctypes.c_int(_PR_SET_SECCOMP), ctypes.c_ulong(_SECCOMP_MODE_FILTER),
                  ctypes.byref(prog), ctypes.c_ulong(0), ctypes.c_ulong(0)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
    return True
