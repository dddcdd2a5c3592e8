"""`HostedLLM`: calls into an ``LLM`` that lives in a host process, with a stand-in ``LLM``
(the real engine in its host: test_vllm_engine.py)."""
import os
import signal
import threading

import pytest

from mcore_rl.engines.vllm_host import EngineHostError, HostedLLM


class StandInLLM:
    """Made in the host from the keyword arguments a ``vllm.LLM`` would get."""

    def __init__(self, model: str, fail: bool = False):
        if fail:
            raise ValueError(f"no model at {model}")
        self.model = model
        self.calls = 0


def describe(llm, suffix: str) -> tuple[str, int, int]:
    llm.calls += 1
    return llm.model + suffix, llm.calls, os.getpid()


def refuse(llm, what: str):
    raise KeyError(what)


def hang(llm):
    threading.Event().wait()


def unpicklable_error(llm):
    raise RuntimeError(threading.Lock())  # the lock does not pickle


class NeedsAReason(Exception):
    def __init__(self, *, reason: str):  # pickles, but unpickling calls it without `reason`
        super().__init__(reason)


def unreadable_error(llm):
    raise NeedsAReason(reason="stale weights")


@pytest.fixture(scope="module")
def host():
    hosted = HostedLLM({"model": "tiny"}, factory=StandInLLM)
    yield hosted
    hosted.shutdown(lambda: None)


def test_calls_run_on_the_llm_in_the_host_and_keep_its_state(host):
    assert host.call(describe, "!") == ("tiny!", 1, host.proc.pid)
    assert host.call(describe, "?")[:2] == ("tiny?", 2)
    assert host.proc.pid != os.getpid()


def test_an_error_in_a_call_is_raised_here_and_the_host_serves_on(host):
    with pytest.raises(KeyError, match="weights"):
        host.call(refuse, "weights")
    with pytest.raises(EngineHostError, match="RuntimeError: <unlocked _thread.lock"):
        host.call(unpicklable_error)
    with pytest.raises(EngineHostError, match="answer to unreadable_error could not be read"):
        host.call(unreadable_error)
    assert host.call(describe, "")[0] == "tiny"


def test_an_llm_that_cannot_start_is_one_error_with_its_cause():
    with pytest.raises(EngineHostError, match="did not start(.|\n)*ValueError: no model at nowhere"):
        HostedLLM({"model": "nowhere", "fail": True}, factory=StandInLLM)


def test_a_host_killed_during_a_call_ends_the_call_naming_its_exit():
    hosted = HostedLLM({"model": "tiny"}, factory=StandInLLM)
    threading.Timer(0.5, os.kill, (hosted.proc.pid, signal.SIGKILL)).start()
    with pytest.raises(EngineHostError, match=f"pid {hosted.proc.pid}.*during hang.*exit code -9"):
        hosted.call(hang)
    hosted.shutdown(lambda: None)
