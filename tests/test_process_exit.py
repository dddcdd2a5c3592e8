"""`mcore_rl.process_exit`: a finished process ends as the interpreter would end it, less
its teardown of every module (seconds after torch and Megatron); the `mcore-rl` command
ends that way."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LINGERING = textwrap.dedent("""
    import atexit, json, os, time

    _LOG = os.environ["EXIT_LOG"]

    def _note(event):
        with open(_LOG, "a") as f:
            f.write(json.dumps(event) + "\\n")

    atexit.register(_note, "atexit")

    class _Lingering:  # deleted by the module teardown: logs, then takes 30 s
        def __init__(self):
            self.file, self.sleep = open(_LOG, "a"), time.sleep

        def __del__(self):
            self.file.write(json.dumps("module_teardown") + "\\n")
            self.file.flush()
            self.sleep(30)

    _KEEP = _Lingering()
""")


def _events(log: Path) -> list[str]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _run(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """``python args`` with a module (sitecustomize) whose teardown would take 30 s."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(LINGERING)
    log = tmp_path / "exit.jsonl"
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "EXIT_LOG": str(log), "PATH": "/usr/bin:/bin"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=60)
    return proc, time.monotonic() - start, _events(log)


def test_exit_now_waits_for_threads_runs_exit_handlers_flushes_and_skips_the_teardown(tmp_path):
    script = textwrap.dedent(f"""
        import sys, threading, time
        from mcore_rl.process_exit import exit_now

        def late():
            time.sleep(0.5)
            open({str(tmp_path / 'thread_done')!r}, "w").close()

        threading.Thread(target=late).start()
        sys.stdout.write("unflushed output")
        exit_now(3)
    """)
    proc, seconds, events = _run(["-c", script], tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed output"
    assert (tmp_path / "thread_done").exists()  # a non-daemon thread is waited for
    assert events == ["atexit"]
    assert seconds < 25  # not the 30 s teardown


def test_the_command_ends_without_the_module_teardown(tmp_path):
    proc, seconds, events = _run(["-m", "mcore_rl.cli.main", "config", "show",
                                  "configs/quickstart.yaml"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rollout:" in proc.stdout
    assert events == ["atexit"]
    assert seconds < 25


def test_a_thread_pool_left_open_does_not_keep_the_process(tmp_path):
    """Its threads end as at any exit (`threading`'s own exit hooks stop them first)."""
    script = textwrap.dedent("""
        from concurrent.futures import ThreadPoolExecutor
        from mcore_rl.process_exit import exit_now

        pool = ThreadPoolExecutor(2)
        assert pool.submit(sum, [1, 2]).result() == 3
        exit_now(5)
    """)
    proc, _, events = _run(["-c", script], tmp_path)
    assert proc.returncode == 5, proc.stderr
    assert events == ["atexit"]
