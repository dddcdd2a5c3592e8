"""``code``: run the Python program in a response against the sample's tests, sandboxed.

The program is the last fenced block tagged ``python`` (or ``py``) in the response, else the
whole response. ``meta["tests"]`` is a non-empty list; each test is either

- a string: Python code run after the program, in its namespace (it runs as module
  ``solution``, so an ``if __name__ == "__main__":`` block does not run), e.g.
  ``"assert add(2, 3) == 5"``; it passes when it raises nothing. All code tests share one
  run of the program.
- a mapping ``{"input": str, "output": str}``: the program runs as ``__main__`` with that
  stdin; it passes when it exits normally and prints that output (trailing whitespace of
  each line and trailing blank lines ignored). One run per test.

Score = tests passed / tests. A run that does not end normally is no partial score: past
``reward.code_time_limit_s`` it is a timeout (`RewardTimeout`, ``reward/timeouts``); one
that does not compile, raises or exits at its top level, or is killed (memory, CPU) is a
failure (`RewardFailure`, ``reward/failures``); both score ``reward.failure_score``.

Sandbox: a fresh ``python -I`` in a temporary directory, in a new network namespace
(``unshare -rn``, or ``unshare -n`` as root: no network, its own loopback), with rlimits
set in the child (address space ``reward.code_memory_mb``, CPU time, file size, no core
dumps), killed with its process group at the time limit. The file system is not isolated,
and a program written to game the in-process code tests could; stdin/stdout tests are
compared outside the sandbox. Where no network namespace can be made, the reward refuses
to start, with one line, when the scorer is built.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

from mcore_rl.errors import UsageError
from mcore_rl.rewards.registry import REWARDS, RewardFailure, RewardTimeout

SANDBOX_PREFIXES: tuple[tuple[str, ...], ...] = (("unshare", "-rn"), ("unshare", "-n"))
"""Commands tried in order to run the program in a new network namespace."""
HARNESS = Path(__file__).with_name("sandbox_harness.py")
_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class SandboxLimits:
    """How a program runs: time and memory limits, and the command prefix that gives it a
    network namespace of its own."""

    time_limit_s: float = 5.0
    memory_mb: int = 512
    prefix: tuple[str, ...] = ("unshare", "-rn")


@lru_cache(maxsize=None)
def sandbox_prefix(candidates: tuple[tuple[str, ...], ...] = SANDBOX_PREFIXES) -> tuple[str, ...]:
    """The first of ``candidates`` that can start a process here; one-line `UsageError`
    if none can."""
    problem = "no command to try"
    for prefix in candidates:
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as err:
            problem = f"{' '.join(prefix)}: {err}"
            continue
        if done.returncode == 0:
            return prefix
        problem = f"{' '.join(prefix)}: " + (done.stderr.strip().splitlines() or
                                             [f"exit status {done.returncode}"])[-1]
    raise UsageError(f"reward 'code' runs programs without network in a new network namespace, "
                     f"which this machine does not permit ({problem}); allow unprivileged user "
                     "namespaces (sysctl kernel.unprivileged_userns_clone=1) or run as root, or "
                     "choose another reward")


def prepare(fn, cfg) -> partial:
    """At scorer build: check the sandbox once and bind the config's limits."""
    limits = SandboxLimits(cfg.code_time_limit_s, cfg.code_memory_mb,
                           sandbox_prefix(SANDBOX_PREFIXES))
    return partial(fn, limits=limits)


def extract_program(response: str) -> str:
    """The last fenced ``python``/``py`` block of the response, else the whole response."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


def _tests_of(meta: dict) -> tuple[list[str], list[tuple[str, str]]]:
    tests = meta.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"meta['tests'] must be a non-empty list of tests, got {tests!r:.60}")
    code, io = [], []
    for t in tests:
        if isinstance(t, str):
            code.append(t)
        elif isinstance(t, dict) and isinstance(t.get("input"), str) \
                and isinstance(t.get("output"), str):
            io.append((t["input"], t["output"]))
        else:
            raise ValueError(f"a test must be Python code (str) or {{'input': str, 'output': str}}, "
                             f"got {t!r:.60}")
    return code, io


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def run_program(directory: Path, mode: str, limits: SandboxLimits, stdin: str = "") -> str:
    """One sandboxed run of ``directory/solution.py``; its stdout. Raises `RewardTimeout`
    or `RewardFailure` when it does not end normally."""
    (directory / "stdin.txt").write_text(stdin)
    cmd = [*limits.prefix, sys.executable, "-I", str(HARNESS), mode,
           str(limits.memory_mb << 20), str(math.ceil(limits.time_limit_s) + 1)]
    with open(directory / "stdin.txt") as fin, open(directory / "stdout.txt", "w+") as fout, \
            open(directory / "stderr.txt", "w+") as ferr:
        proc = subprocess.Popen(cmd, cwd=directory, stdin=fin, stdout=fout, stderr=ferr,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                     "LANG": "C.UTF-8"},
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limits.time_limit_s)
        except subprocess.TimeoutExpired:
            raise RewardTimeout(f"the program ran past {limits.time_limit_s:g} s") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it started
            except ProcessLookupError:
                pass
            proc.wait()
        if code != 0:
            ferr.seek(0)
            last = (ferr.read()[-2000:].strip().splitlines() or [""])[-1][:200]
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            raise RewardFailure(f"the program ended with {how}" + (f": {last}" if last else ""))
        fout.seek(0)
        return fout.read()


def run_tests(program: str, code_tests: list[str], io_tests: list[tuple[str, str]],
              limits: SandboxLimits) -> int:
    """How many tests the program passes (raises when a run does not end normally)."""
    directory = Path(tempfile.mkdtemp(prefix="mcore-rl-code-"))
    try:
        (directory / "solution.py").write_text(program)
        passed = 0
        if code_tests:
            (directory / "tests.json").write_text(json.dumps(code_tests))
            run_program(directory, "tests", limits)
            results = directory / "results.json"
            if not results.exists():
                raise RewardFailure("the program exited before its tests ran")
            passed += sum(json.loads(results.read_text()))
        for stdin, expected in io_tests:
            output = run_program(directory, "main", limits, stdin)
            passed += _normalized(output) == _normalized(expected)
        return passed
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@REWARDS.register("code", prepare=prepare)
def code_reward(prompt: str, response: str, meta: dict, *, limits: SandboxLimits | None = None) -> float:
    """Fraction of ``meta["tests"]`` the response's Python program passes, sandboxed (see
    the module docstring for the test format and what fails)."""
    code_tests, io_tests = _tests_of(meta)
    if limits is None:
        limits = SandboxLimits(prefix=sandbox_prefix(SANDBOX_PREFIXES))
    program = extract_program(response)
    return run_tests(program, code_tests, io_tests, limits) / (len(code_tests) + len(io_tests))
