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

Sandbox (``reward.sandbox``, `mcore_rl.rewards.sandbox`): by default each run is a fresh
process tree in new Linux user, mount, PID, network, IPC and UTS namespaces. The program
sees a read-only root holding only the standard library and the system libraries, a few
devices, a fresh /proc of its own PID namespace and a private writable /tmp (a 64 MiB
tmpfs, its working directory); nothing of the host's home (but the path to an interpreter
installed there), /tmp, /dev/shm, the trainer's directories or Unix sockets, and no network
(its own loopback only). It runs as uid/gid 65534 with no capabilities and no_new_privs, an
allow-listed environment and no inherited file descriptors, under rlimits: address space
``reward.code_memory_mb``, CPU time, file size, 64 processes and threads, no core dumps; at
the time limit the whole tree is killed. It can make no namespace of its own (user
namespaces are forbidden inside its own, so none can give it capabilities). It imports the
standard library only (no site-packages); the system's programs and libraries are in its
read-only view, and none of them gains privileges there (nosuid, no_new_privs). What it
prints past 4 MiB fails the run.
``reward.sandbox: remote`` sends each run to an HTTP sandbox service instead
(``reward.sandbox_url``; protocol in `mcore_rl.rewards.sandbox.protocol`), for machines
that do not permit user namespaces. Measured with ``mcore-rl bench sandbox``
on a loaded 2-core machine, a run costs about 35 ms (median), 1.05 to 1.4 times, typically
1.1 times, the 30-35 ms of the former sandbox (``unshare -rn`` and rlimits, with the file
system not isolated).

Where every code test is ``assert EXPR == LITERAL`` (the literal on either side, as in most
code datasets), only the expressions enter the sandbox: each value comes back as a literal
(made of Python's builtin types; anything else fails its test) and is compared here with
the expected one, which the program never sees. Knowing what to report is then solving the
task, whatever the program does to the interpreter it runs in. Other code tests run in the
program's own interpreter after it: they are compiled before it runs and are never where
it can read them, and the results leave the process after the last test only, behind a
nonce, then the process ends at once. A program that exits before its tests, forges a
results file or descriptor, leaves a process behind to rewrite them, hooks ``atexit`` or
replaces what the harness uses (AssertionError, compile, exec, json.dumps) gains nothing;
one crafted to tamper with the interpreter it shares with such tests (e.g. to find the
nonce) could still forge them. Stdin/stdout tests are compared outside the sandbox too.

Where the configured sandbox cannot run a program, the reward refuses to start, with one
line, when the scorer is built: programs never run unsandboxed.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache, partial
from typing import Any

from mcore_rl.rewards.registry import REWARDS, RewardFailure, RewardTimeout
from mcore_rl.rewards.sandbox import Run, RunResult, SandboxError, SandboxLimits, build_sandbox

_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def prepare(fn, cfg) -> partial:
    """At scorer build: the configured sandbox, with the config's limits, once it has run a
    test program (a one-line `UsageError` if it cannot)."""
    limits = SandboxLimits(cfg.code_time_limit_s, cfg.code_memory_mb)
    return partial(fn, sandbox=build_sandbox(cfg.sandbox, cfg.sandbox_url, limits))


@lru_cache(maxsize=None)
def default_sandbox():
    """The namespace sandbox with the default limits (a call without a scorer)."""
    return build_sandbox("namespaces")


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


def _ended_normally(result: RunResult) -> RunResult:
    if result.status == "timeout":
        raise RewardTimeout(result.message)
    if result.status != "ok":
        raise RewardFailure(result.message)
    return result


def value_test(test: str) -> tuple[str, Any] | None:
    """``assert EXPR == LITERAL`` (the literal on either side): EXPR's source and the
    literal's value; None for any other test."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    check = tree.body[0].test
    if not (isinstance(check, ast.Compare) and len(check.ops) == 1
            and isinstance(check.ops[0], ast.Eq)):
        return None
    for expr, literal in ((check.left, check.comparators[0]), (check.comparators[0], check.left)):
        expected = _literal(literal)
        if expected is not _NOT_LITERAL and _literal(expr) is _NOT_LITERAL:
            return ast.get_source_segment(test, expr), expected
    return None


_NOT_LITERAL = object()


def _literal(node_or_text) -> Any:
    """`ast.literal_eval` of a node or text, `_NOT_LITERAL` where it is not a literal."""
    try:
        return ast.literal_eval(node_or_text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _sandbox_results(sandbox, run: Run) -> tuple:
    result = _ended_normally(sandbox.run(run))
    if result.results is None or len(result.results) != len(run.tests):
        raise SandboxError(f"the sandbox reported {result.results!r:.60} for "
                           f"{len(run.tests)} tests")
    return result.results


def run_tests(program: str, code_tests: list[str], io_tests: list[tuple[str, str]],
              sandbox) -> int:
    """How many tests the program passes (raises when a run does not end normally). Where
    every code test is ``assert EXPR == LITERAL``, only the expressions enter the sandbox
    (mode ``values``) and their values are compared here."""
    passed = 0
    values = [value_test(t) for t in code_tests]
    if code_tests and all(v is not None for v in values):
        got = _sandbox_results(sandbox, Run(program, "values", tuple(e for e, _ in values)))
        for text, (_, expected) in zip(got, values):
            value = _NOT_LITERAL if not isinstance(text, str) else _literal(text)
            passed += value is not _NOT_LITERAL and bool(value == expected)
    elif code_tests:
        passed += sum(_sandbox_results(sandbox, Run(program, "tests", tuple(code_tests))))
    for stdin, expected in io_tests:
        result = _ended_normally(sandbox.run(Run(program, "main", stdin=stdin)))
        passed += _normalized(result.stdout) == _normalized(expected)
    return passed


@REWARDS.register("code", prepare=prepare)
def code_reward(prompt: str, response: str, meta: dict, *, sandbox=None) -> float:
    """Fraction of ``meta["tests"]`` the response's Python program passes, sandboxed (see
    the module docstring for the test format and what fails)."""
    code_tests, io_tests = _tests_of(meta)
    program = extract_program(response)
    passed = run_tests(program, code_tests, io_tests, sandbox or default_sandbox())
    return passed / (len(code_tests) + len(io_tests))
