"""`Unsandboxed`: the code reward's harness run as a plain child of the test process, with
its environment and file system. Tests run a hostile program here first, to show that what
it attempts works without the sandbox (so a sandboxed score of 0 means the sandbox stopped
it, not that the program is broken). Test use only."""
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from mcore_rl.rewards.sandbox import Run, RunResult, SandboxLimits
from mcore_rl.rewards.sandbox.namespaces import INIT

_MAIN = """import json, os, sys
sys.path.insert(0, {directory!r})
import harness
job = json.loads(sys.argv[1])
os._exit(harness.run(job["program"], job["mode"], job["tests"], int(sys.argv[2]), "nonce"))
"""


@dataclass(frozen=True)
class Unsandboxed:
    """Runs programs with no sandbox at all (same `run` as the sandboxes)."""

    limits: SandboxLimits = SandboxLimits(5.0, 512)

    def run(self, run: Run) -> RunResult:
        read, write = os.pipe()
        job = json.dumps({"program": run.program, "mode": run.mode, "tests": list(run.tests)})
        try:
            done = subprocess.run([sys.executable, "-c", _MAIN.format(directory=str(INIT.parent)),
                                   job, str(write)], input=run.stdin, capture_output=True,
                                  text=True, pass_fds=(write,), timeout=self.limits.time_limit_s)
        finally:
            os.close(write)
            with os.fdopen(read) as f:
                raw = f.read()
        if done.returncode:
            return RunResult("failure", done.stdout, message=done.stderr[-200:])
        head, _, body = raw.partition(" ")
        results = tuple(json.loads(body)) if head == "nonce" else None
        if run.mode == "tests" and results is None:
            return RunResult("failure", done.stdout, message="no results")
        return RunResult("ok", done.stdout, results)
