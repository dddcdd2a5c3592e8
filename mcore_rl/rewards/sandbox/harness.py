"""Runs the program and its code tests, in the sandboxed process `namespace_init` forks for
it (called in-process, after the privileges are dropped; nothing here reads the disk).

- ``main`` mode: the program runs as ``__main__`` (a stdin/stdout test; the output is
  compared outside the sandbox).
- ``tests`` mode: the program runs as module ``solution``, then each test (Python code) in
  its namespace; a test passes when it raises nothing. The results (1/0 per test) are
  written once, after the last test, to ``results_fd`` behind a nonce the program is not
  given, and the process then ends at once (`os._exit`: no ``atexit`` handler or finaliser
  of the program runs after its results).

- ``values`` mode: the program runs as module ``solution``, then each test (a Python
  expression) is evaluated in its namespace; what is reported, in the same way, is each
  value as a Python literal (`plain`), or null where it raised or is not made of Python's
  builtin types. The values are compared outside the sandbox, with expected values that
  never enter it: a program that forges this report must still know the right values.

The tests are compiled before the program runs, and are never in the sandbox's files. A
program that fakes results by ending early, writing a results file, hooking ``atexit`` or
replacing exceptions therefore fails; one that inspects the interpreter it shares with the
harness could still forge the results of ``tests`` mode, not those of ``values`` mode (nor
stdin/stdout tests, which are compared outside too).

Standard library only; returns the process's exit status like the interpreter would (an
exception of the program itself: 1, with its traceback on stderr).
"""
import atexit
import json
import os
import sys
import traceback


def _exit_status(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code & 0xFF
    print(err.code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the program may have replaced or closed it
            pass


def _join_threads() -> None:
    """Wait for the program's non-daemon threads (e.g. a ``main`` run in a thread with a
    larger stack, as competitive programs do)."""
    threading = sys.modules.get("threading")
    if threading is None:
        return
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _compiled(tests: list[str], how: str = "exec") -> tuple:
    """Each test's code object (``how``: exec or eval), or None where it does not compile
    (that test fails)."""
    out = []
    for i, test in enumerate(tests):
        try:
            out.append(compile(test, f"test_{i}", how))
        except (SyntaxError, ValueError):
            out.append(None)
    return tuple(out)


_SCALARS = (bool, int, float, complex, str, bytes)


def plain(value):
    """``value`` rebuilt of Python's builtin types only (a subclass of one, e.g. a named
    tuple or an ordered dict, becomes that type; a frozenset, the set it equals); TypeError
    for anything else. Its ``repr`` is then a literal `ast.literal_eval` reads back equal."""
    if value is None:
        return None
    for kind in _SCALARS:
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return {plain(v) for v in value}
    raise TypeError(f"{type(value).__name__} is not a builtin type")


def run(source: str, mode: str, tests: list[str], results_fd: int, nonce: str) -> int:
    """Run ``source`` (and, in ``tests`` and ``values`` mode, ``tests``); the exit status to
    end with."""
    # Everything the tests' part needs is taken before the program runs and can replace it
    compiled = _compiled(tests, "eval" if mode == "values" else "exec")
    run_code, evaluate, dumps, write, as_text = exec, eval, json.dumps, os.write, repr
    as_plain = plain
    settrace, setprofile = sys.settrace, sys.setprofile
    sys.argv = ["solution.py"]
    namespace = {"__name__": "__main__" if mode == "main" else "solution"}
    try:
        run_code(compile(source, "solution.py", "exec"), namespace)
    except SystemExit as err:
        _flush()
        return _exit_status(err)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception
        traceback.print_exc()
        _flush()
        return 1
    if mode == "main":  # end as the interpreter would: its threads, then its atexit handlers
        _join_threads()
        atexit._run_exitfuncs()
        _flush()
        return 0
    results = ()  # a tuple: code the tests call cannot rewrite what is already recorded
    for code in compiled:
        settrace(None)  # no hook of the program steps over a test's lines
        setprofile(None)
        try:
            if code is None:
                raise SyntaxError("the test does not compile")
            if mode == "values":
                results += (as_text(as_plain(evaluate(code, namespace))),)
            else:
                run_code(code, namespace)
                results += (1,)
        except BaseException:  # noqa: BLE001 - any exception fails this test only
            results += (None if mode == "values" else 0,)
    report = f"{nonce} {dumps(list(results))}".encode()
    _flush()
    write(results_fd, report)
    return 0
