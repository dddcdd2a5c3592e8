"""The Linux system calls the namespace sandbox needs and Python 3.11 does not wrap:
unshare, mount, umount2, pivot_root, mount_setattr, capset and prctl, through ctypes.

Each raises `OSError` (with errno) on failure. Standard library only: this module is loaded
by `namespace_init`, which runs as ``python -I -S``.
"""
from __future__ import annotations

import ctypes
import os
import platform

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 1 << 14, 1 << 18, 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4

_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
_MOUNT_SETATTR = 442  # the same number on every architecture
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_CAPABILITY_VERSION_3 = 0x20080522
_EINVAL, _ENOSYS = 22, 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _c(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    _check(_libc.mount(_c(source), _c(target), _c(fstype), ctypes.c_ulong(flags), _c(data)),
           f"mount {fstype or source or ''} on {target}")


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(_c(target), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    number = _PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(_ENOSYS, f"pivot_root: no system call number known on {platform.machine()}")
    _check(_libc.syscall(ctypes.c_long(number), _c(new_root), _c(put_old)), "pivot_root")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def make_read_only_recursively(target: str) -> bool:
    """Read-only, nosuid and nodev on ``target`` and every mount below it (mount_setattr,
    Linux 5.12+); False where the kernel lacks the call."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, 0)
    result = _libc.syscall(ctypes.c_long(_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), _c(target),
                           ctypes.c_uint(_AT_RECURSIVE), ctypes.byref(attr),
                           ctypes.c_size_t(ctypes.sizeof(attr)))
    if result < 0 and ctypes.get_errno() == _ENOSYS:
        return False
    _check(result, f"mount_setattr {target}")
    return True


def locked_mount_flags(path: str) -> int:
    """The flags of the mount holding ``path`` that a remount must keep (a user namespace
    may not clear them)."""
    st = os.statvfs(path)
    flags = 0
    for st_flag, ms_flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
                             (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
                             (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if st.f_flag & st_flag:
            flags |= ms_flag
    return flags


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), f"prctl {option}")


def drop_bounding_set() -> None:
    """Empty the capability bounding set: no execve can bring a capability back. Needs
    CAP_SETPCAP, so it comes before the user ids change."""
    cap = 0
    while True:
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError as err:
            if err.errno == _EINVAL:  # past the last capability this kernel knows
                return
            raise
        cap += 1


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def clear_capabilities() -> None:
    """Empty the ambient, effective, permitted and inheritable sets of this process."""
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_VERSION_3, 0)), data), "capset")
