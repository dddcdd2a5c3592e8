"""``reward.sandbox: remote``: the ``code`` reward through an HTTP sandbox service (here the
reference service, in a thread of the test), refused where the service does not answer,
and stopped (never scored) when it answers something that is not a run result."""
import json
import secrets
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mcore_rl.config import load_config, validate_config
from mcore_rl.config.sections import RewardConfig
from mcore_rl.errors import ConfigError, UsageError
from mcore_rl.rewards import RewardError, RewardScorer
from mcore_rl.rewards.sandbox import Run, SandboxError, SandboxLimits, remote
from mcore_rl.rewards.sandbox.remote import RemoteSandbox
from mcore_rl.rewards.sandbox.service import SandboxService

ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]}


def serve(server):
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    return server


@pytest.fixture(scope="module")
def service():
    server = serve(SandboxService(("127.0.0.1", 0)))
    yield server
    server.shutdown()
    server.server_close()


def remote_scorer(url: str, **options) -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(name="code", failure_score=-1.0, sandbox="remote",
                                                 sandbox_url=url, **options))


def test_the_remote_sandbox_scores_tests_timeouts_and_crashes(service):
    io = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "11"}]}
    responses = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b",
                 "a, b = map(int, input().split())\nprint(a + b)", "while True:\n    pass",
                 "import os\nos._exit(0)"]
    with remote_scorer(service.url, code_time_limit_s=1.0) as s:
        metas = [ADD_TESTS, ADD_TESTS, io, ADD_TESTS, ADD_TESTS]
        scores, metrics = s.score([""] * 5, responses, metas)
    assert scores.tolist() == pytest.approx([1.0, 1 / 3, 0.5, -1.0, -1.0])
    assert metrics["reward/timeouts"] == 1 and metrics["reward/failures"] == 1


def test_a_program_run_by_the_service_reads_nothing_of_its_host(service, tmp_path):
    secret = secrets.token_hex(8)
    (tmp_path / ".netrc").write_text(secret)
    program = f"def leak():\n    return open({str(tmp_path / '.netrc')!r}).read()"
    with remote_scorer(service.url) as s:
        scores, metrics = s.score([""], [program], [{"tests": [f"assert leak() == {secret!r}"]}])
    assert scores.tolist() == [0.0] and metrics["reward/failures"] == 0


def test_the_reward_refuses_to_start_when_no_service_answers():
    closed = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{closed.server_address[1]}/run"
    closed.server_close()
    with pytest.raises(UsageError, match=rf"^reward 'code' runs programs through the sandbox "
                                         rf"service at {url}, which cannot run one \(.*refused"):
        remote_scorer(url)
    with pytest.raises(UsageError, match=r"^reward.sandbox=remote needs reward.sandbox_url"):
        remote_scorer("")


def test_remote_without_an_address_or_an_unknown_sandbox_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^reward.sandbox=remote needs reward.sandbox_url, the "
                                          r"http\(s\):// address of a sandbox service, got ''"):
        validate_config(load_config(None, ["reward.sandbox=remote"]))
    with pytest.raises(ConfigError, match=r"reward.sandbox.*must be one of 'namespaces', 'remote'"):
        load_config(None, ["reward.sandbox=docker"])
    cfg = validate_config(load_config(None, ["reward.sandbox=remote",
                                             "reward.sandbox_url=http://sandbox:8080/run"]))
    assert cfg.reward.sandbox_url == "http://sandbox:8080/run"


def test_the_service_refuses_a_request_that_is_not_a_run(service):
    request = urllib.request.Request(service.url, data=json.dumps({"program": 1}).encode(),
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request)
    assert err.value.code == 400
    assert "'program' is missing or invalid" in json.loads(err.value.read())["error"]


@pytest.mark.parametrize("length", ["-1", "many"])
def test_the_service_refuses_a_length_that_is_not_a_size_before_reading_the_body(service, length):
    import http.client

    host, port = service.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.putrequest("POST", "/run")
    conn.putheader("Content-Length", length)
    conn.endheaders()
    conn.send(b'{"program": "print(1)", "mode": "main", "tests": []}')  # not read: no EOF
    answer = conn.getresponse()
    assert answer.status == 400
    assert "Content-Length must be a non-negative integer" in json.loads(answer.read())["error"]
    conn.close()


class _Broken(BaseHTTPRequestHandler):
    """Answers every request with ``server.answer`` (status, body), counting them."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        status, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answer, requests, problem", [
    ((503, b"overloaded"), remote.ATTEMPTS, r"did not answer \(HTTP 503: overloaded\)"),
    ((400, b"bad request"), 1, r"did not answer \(HTTP 400: bad request\)"),
    ((200, b"<html>"), 1, r"answered something that is not JSON"),
    ((200, b'{"status": "passed"}'), 1, r"answer is not a run result"),
])
def test_a_service_that_does_not_answer_a_result_stops_the_reward(monkeypatch, answer, requests,
                                                                  problem):
    monkeypatch.setattr(remote, "RETRY_PAUSE_S", 0.0)
    broken = serve(ThreadingHTTPServer(("127.0.0.1", 0), _Broken))
    broken.answer, broken.requests = answer, 0
    url = f"http://127.0.0.1:{broken.server_address[1]}/run"
    try:
        with pytest.raises(SandboxError, match=problem):
            RemoteSandbox(url, SandboxLimits(1.0, 64)).run(Run("print(1)", "main"))
        assert broken.requests == requests
        broken.answer = (200, json.dumps({"status": "ok", "stdout": "ok\n", "results": None,
                                          "message": ""}).encode())
        with remote_scorer(url) as s:  # the check passes; the run itself gets the bad answer
            broken.answer = answer
            with pytest.raises(RewardError, match=r"raised SandboxError: .*" + problem):
                s.score([""], ["def add(a, b):\n    return a + b"], [ADD_TESTS])
    finally:
        broken.shutdown()
        broken.server_close()
