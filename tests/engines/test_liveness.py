"""How `EngineProcesses` names an engine's processes in a failure: by their title, or,
where the title did not take (setproctitle could not find the command line), by the name
the process was started under, not as the Python executable."""
import multiprocessing
import time

import pytest

from mcore_rl.engines.liveness import EngineProcesses
from mcore_rl.process_title import titled


@pytest.fixture
def spawned():
    procs = []

    def start(target, args, name):
        proc = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name,
                                                            daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.join()


def _label(proc, expected: str, within_s: float = 60.0) -> str:
    """The label of ``proc`` once its command line reads ``expected`` (a spawned process
    sets its title after its imports), or the last one seen."""
    deadline = time.monotonic() + within_s
    while True:
        label = EngineProcesses("vllm", {proc.pid}).labels[proc.pid]
        if label == expected or time.monotonic() > deadline:
            return label
        time.sleep(0.1)


def test_a_titled_process_is_named_by_its_title(spawned):
    proc = spawned(titled, ("VLLM::EngineCore", time.sleep, 60), "EngineCore_DP0")
    assert _label(proc, "VLLM::EngineCore") == "VLLM::EngineCore"


def test_an_untitled_process_is_named_as_it_was_started_not_as_python(spawned):
    proc = spawned(time.sleep, (60,), "EngineCore_DP0")
    assert _label(proc, "EngineCore_DP0", within_s=5.0) == "EngineCore_DP0"


def test_an_engines_processes_are_found_titled_or_not_and_nothing_else_is(spawned):
    """`_child_pids`: what starts an engine (named as our host, vLLM's engine core or its
    workers are) is watched and killed with it, whether vLLM's title took or not; another
    spawned process of this one, or a plain subprocess, is not the engine's."""
    import subprocess
    import sys

    from mcore_rl.engines.vllm_engine import _child_pids

    # what an engine closed earlier in this process left in `multiprocessing`'s children
    # (reaped by psutil, so never joined), as `VLLMEngine` subtracts it when it starts
    before = _child_pids()
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = spawned(titled, ("VLLM::EngineCore", time.sleep, 60), "VLLM::EngineCore")
        untitled = spawned(time.sleep, (60,), "EngineCore_DP0")
        other = spawned(time.sleep, (60,), "RewardWorker-1")
        _label(host, "VLLM::EngineCore")
        found = _child_pids() - before
    finally:
        plain.kill()
        plain.wait()
    assert found == {host.pid, untitled.pid}, (found, host.pid, untitled.pid, other.pid)
