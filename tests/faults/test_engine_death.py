"""An engine that dies ends the run with a named error instead of a hang, and an engine
never outlives the trainer that owns it.

- SIGKILL of vLLM's engine core during a generation: `EngineDiedError` within 60 s, naming
  the process, the signal and the engine's last output;
- SIGKILL of the engine before a weight sync (from the reward function of the run):
  ``mcore-rl train`` exits 1 with that error;
- SIGKILL of the trainer: none of its engine processes is alive 10 s later.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from mcore_rl.engines import SamplingConfig
from mcore_rl.engines.liveness import untitled_spawn
from mcore_rl.roles.graph import PROCESS_MAP
from tests.flow.helpers import alive
from tests.models.tiny_hf import save_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]
RUN = ["rollout.engine=vllm", "train.warm_start_steps=0", "train.val_every=0",
       "checkpoint.save_every=0", "logging.progress_bar=false", "logging.backends=[jsonl]",
       "logging.samples_every=0", "reshard.verify=false"]


ENGINE_NAME = r"(VLLM::EngineCore|EngineCore_DP0)"
"""How a failure names vLLM's engine core: its title, or where vLLM's title did not take
(`mcore_rl.process_title`), the name vLLM started it under."""


def engine_core(controller_pid: int, within_s: float = 10.0) -> int:
    """The vLLM engine core process a rollout controller started: its child titled
    ``VLLM::EngineCore``, or, where the title did not take (`mcore_rl.process_title`; our
    host and vLLM's plugin of ours write it, `mcore_rl.engines.vllm_title`), its spawned
    child that is not multiprocessing's resource tracker. Looked for again for a while
    (under load the title may not read yet); what is there instead names the miss."""
    deadline = time.monotonic() + within_s
    while True:
        seen, spawned = [], {}
        for proc in psutil.Process(controller_pid).children(recursive=True):
            try:
                cmdline = proc.cmdline()
                if untitled_spawn(cmdline):
                    spawned[proc.pid] = proc.ppid()
            except psutil.Error as err:
                seen.append((proc.pid, type(err).__name__))
                continue
            if cmdline[:1] and cmdline[0].startswith("VLLM::EngineCore"):
                return proc.pid
            seen.append((proc.pid, cmdline[:2]))
        topmost = [pid for pid, parent in spawned.items() if parent not in spawned]
        if len(topmost) == 1 and time.monotonic() > deadline - within_s / 2:
            return topmost[0]  # its workers are spawned by it
        if time.monotonic() > deadline:
            raise AssertionError(f"no engine core under rollout process {controller_pid}: {seen}")
        time.sleep(0.2)


def _of_run(root_pid: int) -> list[psutil.Process]:
    """The processes of a run started in a session of its own (``root_pid`` leads it):
    its descendants, and whatever else is in its session (a process whose parent died is
    no one's descendant any more)."""
    procs = {p.pid: p for p in psutil.Process(root_pid).children(recursive=True)}
    for p in psutil.process_iter():
        try:
            if p.pid != root_pid and os.getsid(p.pid) == root_pid:
                procs.setdefault(p.pid, p)
        except (psutil.Error, OSError):
            pass
    return list(procs.values())


def _names(root_pid: int) -> list[str]:
    names = []
    for p in _of_run(root_pid):
        try:
            names.append(" ".join(p.cmdline())[:80])
        except psutil.Error:
            pass
    return names


def test_a_generation_whose_engine_is_killed_fails_within_60s_naming_the_signal(tmp_path):
    from mcore_rl.engines.liveness import EngineDiedError
    from mcore_rl.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(save_tiny_hf_model("llama-tied", tmp_path / "m")), max_model_len=256)
    try:
        engine.generate([[5, 6, 7]], SamplingConfig(max_new_tokens=2))
        (core,) = engine.process_ids()
        long = SamplingConfig(n=64, max_new_tokens=250, min_new_tokens=250, temperature=1.0, seed=1)
        killer = threading.Timer(1.0, os.kill, args=(core, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(EngineDiedError) as err:
            engine.generate([[5, 6, 7]] * 16, long)
        elapsed = time.monotonic() - start
    finally:
        engine.close()
    message = str(err.value)
    assert elapsed < 60, elapsed
    assert re.match(rf"the vllm engine died during generate: {ENGINE_NAME} \(pid {core}\) "
                    r"killed by signal 9 \(SIGKILL\)", message), message
    assert "its last output:" in message and len(message.splitlines()) > 2, message


MARK = "MCORE_RL_TEST_RUN"
KILLED = "killed_engine_cores.txt"


def run_engine_core(run: Path) -> int:
    """The engine core of the run logging to ``run``: under the rollout process that its
    process map names."""
    owner = json.loads((run / PROCESS_MAP).read_text())["processes"]["rollout#0"][0]
    return engine_core(owner)


def reward_that_kills_the_engine_at_step_2(prompt, response, meta):
    """Exact match; the 17th call (step 2, with 16 samples per step, scored in the trainer's
    process) kills the run's engine core: the child of the rollout process that the run's
    ``processes.json`` names (``MARK`` holds the run's logging.dir), and writes its pid to
    ``KILLED`` there. An exception here would only count as a reward error, so a miss is
    written down instead, for the test to report."""
    global _calls
    _calls = globals().get("_calls", 0) + 1
    if _calls == 17:
        run = Path(os.environ[MARK])
        try:
            core = run_engine_core(run)
            os.kill(core, signal.SIGKILL)
            (run / KILLED).write_text(str(core))
        except Exception as err:  # noqa: BLE001 - reported by the test
            (run / KILLED).write_text(f"not killed: {type(err).__name__}: {err}")
    return float(response.strip() == str(meta["answer"]))


def test_an_engine_killed_before_a_weight_sync_ends_the_run_with_the_named_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/quickstart.yaml", *RUN,
         "train.steps=6", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
         f"reward.name={__name__}:reward_that_kills_the_engine_at_step_2",
         f"logging.dir={tmp_path}"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, MARK: str(tmp_path)})
    killed = (tmp_path / KILLED).read_text() if (tmp_path / KILLED).exists() else "no kill"
    assert killed.isdigit(), killed
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mcore-rl train: error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.match(rf"mcore-rl train: error: the vllm engine died during the weight sync: "
                    rf"{ENGINE_NAME} \(pid \d+\)", errors[0]), errors[0]
    assert "killed by signal 9 (SIGKILL)" in errors[0]
    ours = [line for line in proc.stderr.splitlines() if not line.startswith("  | ")]
    assert not any("Traceback" in line for line in ours), proc.stderr[-3000:]  # the engine's may
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1], steps


def test_no_engine_process_outlives_a_killed_trainer(tmp_path):
    output = tmp_path / "output.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/quickstart.yaml", *RUN,
         "train.steps=500", f"logging.dir={tmp_path}"],
        stdout=output.open("w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        try:
            engine = [psutil.Process(run_engine_core(tmp_path))]
        except AssertionError:
            engine = []
        engine += [c for p in engine for c in p.children(recursive=True)]
        state = "is running" if proc.poll() is None else f"exited with status {proc.returncode}"
        assert engine, (f"no engine process found; the run {state}; its processes: "
                        f"{_names(proc.pid)}; its output ends:\n{output.read_text()[-3000:]}")
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p.pid) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p.pid for p in engine if alive(p.pid)]
    try:  # Ray's own agents outlive a SIGKILLed driver for a minute or two: end them here
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert left == [], f"engine processes {left} outlived the trainer by 10 s"
