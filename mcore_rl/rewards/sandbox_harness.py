"""Runs inside the code reward's sandbox, as ``python -I sandbox_harness.py MODE MEM CPU``
in a temporary directory holding ``solution.py`` (and, in ``tests`` mode, ``tests.json``).

It limits its own address space (MEM bytes), CPU time (CPU seconds), file size and core
dumps, asks to be killed if its parent dies, then runs the solution:

- ``main`` mode: as ``__main__`` (a stdin/stdout test; the parent compares the output);
- ``tests`` mode: as module ``solution``, then each test (Python code) in its namespace,
  writing ``results.json`` (1/0 per test: ran without an exception or not) at the end.
  ``tests.json`` is read and removed before the solution runs.

An exception of the solution itself ends the process with status 1. Standard library only.
"""
import ctypes
import json
import os
import resource
import signal
import sys


def limit(memory_bytes: int, cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:  # PR_SET_PDEATHSIG: a killed reward worker takes its program with it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main() -> None:
    mode, memory_bytes, cpu_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tests = []
    if mode == "tests":  # read, then removed: the solution cannot read the tests
        with open("tests.json") as f:
            tests = json.load(f)
        os.remove("tests.json")
    with open("solution.py") as f:
        source = f.read()
    limit(memory_bytes, cpu_s)
    sys.argv = ["solution.py"]
    namespace = {"__name__": "__main__" if mode == "main" else "solution"}
    exec(compile(source, "solution.py", "exec"), namespace)
    if mode != "tests":
        return
    results = []
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}", "exec"), namespace)
            results.append(1)
        except BaseException:  # noqa: BLE001 - any exception fails this test only
            results.append(0)
    with open("results.json", "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
