"""`mcore-rl bench sandbox`: wall time of one sandboxed run of a program (the ``code`` reward).

    mcore-rl bench sandbox --json OUT.json [--repeats 40]

Ours: `NamespaceSandbox` (user, mount, PID, network, IPC and UTS namespaces, a pivot_root
into a read-only view with a fresh /proc and a private /tmp, uid 65534 with no
capabilities). Baseline, measured in the same run, alternating with ours run by run: the
sandbox it replaced, ``unshare -rn python -I harness.py`` (a network namespace and rlimits
only) in a temporary directory holding the program, its tests and its results. Two
workloads: a program with three code tests (one run) and a stdin/stdout program (one run).
Each record holds the median milliseconds per run, ``{"ours", "baseline", "unit",
"speedup"}`` (speedup < 1: ours is slower); the target is ours <= 2x the baseline.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcore_rl.benchmarks._common import machine_info, rounded, time_comparison, write_json
from mcore_rl.rewards.sandbox import NamespaceSandbox, Run, SandboxLimits

TARGET_SLOWDOWN = 2.0
WORKLOADS = {
    "code_tests": Run("def add(a, b):\n    return a + b\n", "tests",
                      ("assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5")),
    "stdin_stdout": Run("a, b = map(int, input().split())\nprint(a + b)\n", "main", stdin="2 3\n"),
}
# The harness of the former sandbox: files in the working directory, rlimits, no namespaces
# but the network one its command gave it.
_FORMER_HARNESS = r"""
import json, os, resource, sys
mode, memory_bytes, cpu_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tests = []
if mode == "tests":
    with open("tests.json") as f:
        tests = json.load(f)
    os.remove("tests.json")
with open("solution.py") as f:
    source = f.read()
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
namespace = {"__name__": "__main__" if mode == "main" else "solution"}
exec(compile(source, "solution.py", "exec"), namespace)
if mode == "tests":
    results = []
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}", "exec"), namespace)
            results.append(1)
        except BaseException:
            results.append(0)
    with open("results.json", "w") as out:
        json.dump(results, out)
"""


def former_sandbox_run(run: Run, limits: SandboxLimits, harness: Path) -> str:
    """One run the way the former sandbox ran it; its stdout (and results, in tests mode)."""
    directory = Path(tempfile.mkdtemp(prefix="mcore-rl-code-"))
    try:
        (directory / "solution.py").write_text(run.program)
        (directory / "stdin.txt").write_text(run.stdin)
        if run.mode == "tests":
            (directory / "tests.json").write_text(json.dumps(list(run.tests)))
        cmd = ["unshare", "-rn", sys.executable, "-I", str(harness), run.mode,
               str(limits.memory_mb << 20), str(math.ceil(limits.time_limit_s) + 1)]
        with open(directory / "stdin.txt") as fin:
            done = subprocess.run(cmd, cwd=directory, stdin=fin, capture_output=True, text=True,
                                  env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                       "LANG": "C.UTF-8"},
                                  start_new_session=True, timeout=limits.time_limit_s)
        if done.returncode:
            raise RuntimeError(f"the former sandbox failed: {done.stderr[-300:]}")
        results = directory / "results.json"
        return done.stdout + (results.read_text() if results.exists() else "")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _timed(fn):
    """(milliseconds, what ``fn()`` returned)."""
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1e3, value


def measure(repeats: int) -> dict:
    """Median ms per run of each workload, ours and the baseline alternating."""
    limits = SandboxLimits(10.0, 512)
    ours = NamespaceSandbox(limits)
    report = {}
    with tempfile.TemporaryDirectory(prefix="mcore-rl-bench-sandbox-") as tmp:
        harness = Path(tmp) / "harness.py"
        harness.write_text(_FORMER_HARNESS)
        for name, run in WORKLOADS.items():
            for _ in range(2):  # warm-up: page cache, first imports
                ours.run(run)
                former_sandbox_run(run, limits, harness)
            times: dict[str, list[float]] = {"ours": [], "baseline": []}
            for _ in range(repeats):
                ms, result = _timed(lambda: ours.run(run))
                if result.status != "ok":
                    raise RuntimeError(f"{name}: the sandbox run failed: {result.message}")
                times["ours"].append(ms)
                ms, _ = _timed(lambda: former_sandbox_run(run, limits, harness))
                times["baseline"].append(ms)
            report[name] = {**time_comparison(statistics.median(times["ours"]),
                                              statistics.median(times["baseline"]), "ms/run"),
                            "ours_quartiles": statistics.quantiles(times["ours"], n=4),
                            "baseline_quartiles": statistics.quantiles(times["baseline"], n=4)}
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mcore-rl bench sandbox",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--repeats", type=int, default=40, help="runs of each side per workload")
    args = parser.parse_args(argv)
    comparisons = measure(args.repeats)
    worst = min(c["speedup"] for c in comparisons.values())
    report = rounded({"benchmark": "sandbox", "machine": machine_info(),
                      "baseline": "unshare -rn python -I harness.py (network namespace, rlimits)",
                      **comparisons,
                      "target": {"max_slowdown": TARGET_SLOWDOWN, "worst_slowdown": 1 / worst,
                                 "met": 1 / worst <= TARGET_SLOWDOWN}})
    write_json(args.json, report)
    print(json.dumps(report, indent=2))
    return 0
