"""What a sandbox runs and what it answers: `Run`, `RunResult`, `SandboxLimits`, and their
JSON form, which is also the protocol of a remote sandbox service (``reward.sandbox:
remote``).

The service takes ``POST <reward.sandbox_url>`` with ``Content-Type: application/json``::

    {"program": "def add(a, b): ...",      # Python source
     "mode": "tests",                     # "tests": run it as module `solution`, then each
                                          #   test in its namespace; "values": the same,
                                          #   each test an expression; "main": as __main__
     "tests": ["assert add(1, 2) == 3"],  # mode "tests": Python code, passes if it raises
                                          #   nothing; mode "values": expressions, e.g.
                                          #   "add(1, 2)" (mode "main": [])
     "stdin": "",                         # the program's standard input
     "time_limit_s": 5.0,                 # wall-clock limit of the run
     "memory_mb": 512}                    # address-space limit

and answers ``200`` with::

    {"status": "ok",         # "ok": ended normally; "failure": crashed, was killed or exited
                             #   non-zero; "timeout": ran past time_limit_s
     "stdout": "...",        # the program's standard output
     "results": [1],         # status "ok": mode "tests": 1/0 per test; mode "values":
                             #   per expression its value as a Python literal ("3"), or
                             #   null where it raised or is not of builtin types; else null
     "message": ""}          # why it failed, one line (empty when ok)

Any other answer (status code, body) is a fault of the service, not of the program: the
reward stops with that error rather than score it. The service must give the program no
network and nothing of its host, and must enforce both limits. ``GET`` of the same URL is
not used. `mcore_rl.rewards.sandbox.service` is a reference service.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

STATUSES = ("ok", "failure", "timeout")
MODES = ("tests", "values", "main")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it): the reward cannot score."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run of a program."""

    time_limit_s: float = 5.0
    memory_mb: int = 512


@dataclass(frozen=True)
class Run:
    """One run of a program: its tests (mode ``tests``), the values of expressions after it
    (mode ``values``) or its stdin (mode ``main``)."""

    program: str
    mode: Literal["tests", "values", "main"]
    tests: tuple[str, ...] = ()
    stdin: str = ""

    def to_json(self, limits: SandboxLimits) -> dict:
        return {"program": self.program, "mode": self.mode, "tests": list(self.tests),
                "stdin": self.stdin, "time_limit_s": limits.time_limit_s,
                "memory_mb": limits.memory_mb}

    @staticmethod
    def from_json(data: dict) -> tuple[Run, SandboxLimits]:
        """A request body as a run and its limits; `ValueError` naming the bad field."""
        def field(name, types, check=lambda v: True):
            value = data.get(name) if isinstance(data, dict) else None
            if not isinstance(value, types) or isinstance(value, bool) or not check(value):
                raise ValueError(f"field {name!r} is missing or invalid: {value!r:.60}")
            return value

        program = field("program", str)
        mode = field("mode", str, lambda v: v in MODES)
        tests = field("tests", list, lambda v: all(isinstance(t, str) for t in v))
        run = Run(program, mode, tuple(tests), field("stdin", str))
        limits = SandboxLimits(float(field("time_limit_s", (int, float), lambda v: v > 0)),
                               field("memory_mb", int, lambda v: v >= 16))
        return run, limits


@dataclass(frozen=True)
class RunResult:
    """How a run ended (``status`` in `STATUSES`), its stdout, and in mode ``tests`` the
    1/0 result of each test, in mode ``values`` each expression's value as a literal or
    None (None unless the program ran to its end and reported them)."""

    status: str
    stdout: str = ""
    results: tuple[int | str | None, ...] | None = None
    message: str = ""

    def to_json(self) -> dict:
        return {"status": self.status, "stdout": self.stdout,
                "results": None if self.results is None else list(self.results),
                "message": self.message}

    @staticmethod
    def from_json(data) -> RunResult:
        """A service's answer as a result; `SandboxError` if it is not one."""
        ok = (isinstance(data, dict) and data.get("status") in STATUSES
              and isinstance(data.get("stdout"), str) and isinstance(data.get("message", ""), str)
              and (data.get("results") is None
                   or (isinstance(data["results"], list)
                       and all(r is None or isinstance(r, str) or
                               (isinstance(r, int) and r in (0, 1)) for r in data["results"]))))
        if not ok:
            raise SandboxError(f"the sandbox service's answer is not a run result: {data!r:.120}")
        results = data.get("results")
        return RunResult(data["status"], data["stdout"],
                         None if results is None else
                         tuple(r if r is None or isinstance(r, str) else int(r) for r in results),
                         data.get("message", ""))
