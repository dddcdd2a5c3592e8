"""A reference sandbox service for ``reward.sandbox: remote``: it answers the protocol of
`protocol` by running each program in a `NamespaceSandbox` on its own machine, which must
permit user namespaces::

    python -m mcore_rl.rewards.sandbox.service --host 0.0.0.0 --port 8080
    # trainers: reward.sandbox=remote reward.sandbox_url=http://HOST:8080/run

It serves any path, one thread per request, and caps the limits a request asks for. It
has no authentication: serve it only to the trainers' network.
"""
from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mcore_rl.rewards.sandbox.namespaces import NamespaceSandbox
from mcore_rl.rewards.sandbox.protocol import Run, SandboxError, SandboxLimits

MAX_BODY_BYTES = 16 << 20


class SandboxService(ThreadingHTTPServer):
    """An HTTP server of the sandbox protocol; ``max_limits`` caps what a request asks."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int],
                 max_limits: SandboxLimits = SandboxLimits(60.0, 4096)):
        super().__init__(address, _Handler)
        self.max_limits = max_limits

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/run"


class _Handler(BaseHTTPRequestHandler):
    server: SandboxService

    def _answer(self, code: int, data: dict) -> None:
        body = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._answer(400, {"error": "Content-Length must be a non-negative integer"})
            return
        if length > MAX_BODY_BYTES:
            self._answer(413, {"error": f"the request is larger than {MAX_BODY_BYTES} bytes"})
            return
        try:
            run, asked = Run.from_json(json.loads(self.rfile.read(length)))
        except ValueError as err:
            self._answer(400, {"error": f"not a run request: {err}"})
            return
        cap = self.server.max_limits
        limits = SandboxLimits(min(asked.time_limit_s, cap.time_limit_s),
                               min(asked.memory_mb, cap.memory_mb))
        try:
            result = NamespaceSandbox(limits).run(run)
        except SandboxError as err:
            self._answer(503, {"error": f"the sandbox cannot run programs here: {err}"})
            return
        self._answer(200, result.to_json())

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        pass  # one line per program would drown a service's log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    try:
        NamespaceSandbox().check()
    except SandboxError as err:
        parser.exit(1, f"error: this machine cannot run sandboxed programs ({err})\n")
    server = SandboxService((args.host, args.port))
    print(f"sandbox service at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
