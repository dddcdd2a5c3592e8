"""The file system a sandboxed program sees, built by the init of its namespaces
(`namespace_init`) in a private mount namespace, then entered with pivot_root:

- ``/``: a tiny tmpfs, read-only once built;
- read-only (and nosuid, nodev) binds of the interpreter's standard library (its
  ``sys.path``), the directories of the shared libraries it has loaded, the system library
  directories and ``/etc/ld.so.cache``, each at its own path, with the symbolic links on the
  way to it (``/lib -> usr/lib``) recreated;
- ``/dev/{null,zero,full,random,urandom}`` (binds of the host's devices) and ``/dev/fd``,
  ``/dev/std{in,out,err}`` links;
- ``/proc``: a fresh proc of the new PID namespace (the host's processes do not exist there);
- ``/tmp``: a fresh writable tmpfs of ``workdir_mb`` MiB, owned by the sandbox user, holding
  ``solution.py``: the working directory and home.

Nothing else: not the host's home (an interpreter installed under it shows as that one
path), /tmp, /dev/shm, /run, /etc, the trainer's directories or any Unix socket. Standard
library only (loaded by `namespace_init`, ``python -I -S``).
"""
from __future__ import annotations

import os
import sys

import syscalls as sc

BUILD_AT = "/tmp"
"""Where the new root's tmpfs is mounted while it is built (in the private mount namespace
only; the bind sources are opened before, so it hides none of them)."""
SYSTEM_LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEVICE_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0",
                "/dev/stdout": "/proc/self/fd/1", "/dev/stderr": "/proc/self/fd/2"}


def _loaded_library_dirs() -> list[str]:
    with open("/proc/self/maps") as maps:
        fields = [line.split(None, 5) for line in maps]
    paths = {f[5].strip() for f in fields if len(f) == 6}
    return sorted({os.path.dirname(p) for p in paths if p.startswith("/") and ".so" in p})


def _resolve(path: str, links: dict[str, str], depth: int = 0) -> str:
    """The real path of ``path``; every symbolic link met on the way goes into ``links``
    (its path -> its target) so that the same path resolves alike in the new root."""
    if depth > 40:
        raise OSError(40, f"too many levels of symbolic links resolving {path}")
    current = "/"
    for part in path.split("/"):
        if not part or part == ".":
            continue
        step = os.path.join(current, part)
        if os.path.islink(step):
            links[step] = os.readlink(step)
            step = _resolve(os.path.normpath(os.path.join(current, links[step])), links, depth + 1)
        elif part == "..":
            step = os.path.dirname(current)
        current = step
    return current


def plan_view() -> tuple[dict[str, str], list[str]]:
    """(symbolic links to recreate, real paths to bind read-only), outermost paths only."""
    links: dict[str, str] = {}
    stdlib = [p for p in sys.path if os.path.isdir(p)]  # -I -S: standard library, lib-dynload
    wanted = [*stdlib, *_loaded_library_dirs(), *SYSTEM_LIBRARIES]
    reals = sorted({_resolve(p, links) for p in wanted if os.path.exists(p)})
    outermost: list[str] = []
    for real in reals:  # sorted: a directory comes before what lies inside it
        if not any(real.startswith(kept.rstrip("/") + "/") for kept in outermost):
            outermost.append(real)
    return links, outermost


def _mountpoint(path: str, is_dir: bool) -> str:
    target = BUILD_AT + path
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    return target


def _bind_read_only(fd: int, path: str) -> None:
    target = _mountpoint(path, os.path.isdir(path))
    source = f"/proc/self/fd/{fd}"
    sc.mount(source, target, None, sc.MS_BIND | sc.MS_REC)
    if sc.make_read_only_recursively(target):
        return
    # Before Linux 5.12: the top mount only, so nothing below it is bound at all
    sc.umount2(target, sc.MNT_DETACH)
    sc.mount(source, target, None, sc.MS_BIND)
    sc.mount(None, target, None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | sc.MS_NOSUID
             | sc.MS_NODEV | sc.locked_mount_flags(target))


def build_and_enter(files: dict[str, str], workdir_mb: int, sandbox_id: int) -> None:
    """Build the new root (see the module docstring), with ``files`` (name -> text) in
    its /tmp, and pivot_root into it; the working directory is then /tmp."""
    links, binds = plan_view()
    # O_PATH descriptors first: the sources stay reachable whatever the new root shadows
    sources = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in (*binds, *DEVICES)}
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)  # nothing propagates to the host
    sc.mount("tmpfs", BUILD_AT, "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, "size=1m,mode=0755")
    for path, target in {**links, **DEVICE_LINKS}.items():
        os.makedirs(os.path.dirname(BUILD_AT + path), exist_ok=True)
        os.symlink(target, BUILD_AT + path)
    for path in binds:
        _bind_read_only(sources[path], path)
    for path in DEVICES:
        sc.mount(f"/proc/self/fd/{sources[path]}", _mountpoint(path, False), None, sc.MS_BIND)
    for fd in sources.values():
        os.close(fd)
    sc.mount("proc", _mountpoint("/proc", True), "proc",  # of the new PID namespace
             sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
    workdir = _mountpoint("/tmp", True)
    sc.mount("tmpfs", workdir, "tmpfs", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC,
             f"size={workdir_mb}m,nr_inodes=4096,mode=0755,uid={sandbox_id},gid={sandbox_id}")
    for name, text in files.items():
        with open(os.path.join(workdir, name), "w") as f:
            f.write(text)
    os.chdir(BUILD_AT)
    sc.pivot_root(".", ".")  # the old root now sits on top of the new one ...
    sc.umount2(".", sc.MNT_DETACH)  # ... and is detached, with everything under it
    sc.mount(None, "/", None,
             sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | sc.MS_NOSUID | sc.MS_NODEV)
    os.chdir("/tmp")
