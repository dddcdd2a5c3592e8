"""`RemoteSandbox`: runs programs through an HTTP sandbox service (``reward.sandbox:
remote``, at ``reward.sandbox_url``), for machines that do not permit user namespaces.
The protocol is in `protocol`; `service` is a reference service.

Each run is one POST. A refused connection, a server error (5xx) or a timeout is tried
again (`ATTEMPTS` in all, `RETRY_PAUSE_S` apart); then, like any answer that is not a run
result, it is a `SandboxError`: the reward stops rather than score programs it could not
run. Proxy settings of the environment are not used (the service is a direct peer).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from mcore_rl.rewards.sandbox.protocol import Run, RunResult, SandboxError, SandboxLimits

ATTEMPTS = 3
RETRY_PAUSE_S = 1.0
SLACK_S = 30.0
"""How much longer than the run's time limit the service may take to answer (queueing,
start-up)."""
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _first_line(data: bytes) -> str:
    return (data.decode("utf-8", "replace").strip().splitlines() or [""])[0][:200]


@dataclass(frozen=True)
class RemoteSandbox:
    """Runs programs through the sandbox service at ``url``."""

    url: str
    limits: SandboxLimits = SandboxLimits()

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with _OPENER.open(request, timeout=self.limits.time_limit_s + SLACK_S) as response:
            return response.read()

    def run(self, run: Run, attempts: int = ATTEMPTS) -> RunResult:
        """One run through the service; `SandboxError` if it does not answer with a result."""
        body = json.dumps(run.to_json(self.limits)).encode()
        problem = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(RETRY_PAUSE_S)
            try:
                answer = self._post(body)
            except urllib.error.HTTPError as err:
                problem = f"HTTP {err.code}: {_first_line(err.read())}"
                if err.code < 500:
                    break  # the request itself is refused: asking again will not help
                continue
            except (urllib.error.URLError, OSError) as err:
                problem = str(getattr(err, "reason", err))
                continue
            try:
                return RunResult.from_json(json.loads(answer))
            except ValueError:
                raise SandboxError(f"the sandbox service at {self.url} answered something that "
                                   f"is not JSON: {_first_line(answer)!r}") from None
        raise SandboxError(f"the sandbox service at {self.url} did not answer ({problem})")

    def check(self) -> None:
        """Raise `SandboxError` (its reason) unless the service runs a test program."""
        done = RemoteSandbox(self.url, SandboxLimits(30.0, 256)).run(Run("print('ok')", "main"),
                                                                     attempts=1)
        if done.status != "ok" or done.stdout != "ok\n":
            raise SandboxError(f"a test program gave {done.status} {done.stdout!r:.60} "
                               f"{done.message}".rstrip())
