"""The stop protocol on real ranks: a signal or the stop file on one rank stops all of them."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.launch.stop_signal import StopSignal
from tests.world import SharedWorld

REPO = Path(__file__).resolve().parents[2]


def _ctx(rank=0):
    return SimpleNamespace(device=torch.device("cpu"), rank=rank)


def test_a_caught_sigterm_becomes_a_stop_request_instead_of_ending_the_process(tmp_path):
    stop = StopSignal(stop_file=tmp_path / "stop").install()
    try:
        assert not stop.should_stop(_ctx())
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.should_stop(_ctx())
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_second_signal_of_the_same_kind_ends_the_process():
    code = ("import os, signal, time\n"
            "from mcore_rl.launch.stop_signal import StopSignal\n"
            "s = StopSignal(stop_file='').install()\n"
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
            "print('first caught', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(5); print('still alive')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "first caught" and proc.returncode == -signal.SIGUSR1


def _agree(rank, world_size, stop_dir, who_sees):
    """Each rank reports its decision at two step boundaries; only ``who_sees`` sees a request."""
    ctx = _ctx(rank)
    stop = StopSignal(stop_file=os.path.join(stop_dir, f"stop-seen-by-{rank}"))
    before = stop.should_stop(ctx)
    if rank == who_sees:
        open(stop.stop_file, "w").close()
    after = stop.should_stop(ctx)
    ack = stop.acknowledge(ctx, step=7)
    return before, after, str(ack) if ack else None


@pytest.fixture(scope="module")
def world():
    with SharedWorld(2) as w:
        yield w


@pytest.mark.parametrize("who_sees", [0, 1])
def test_all_ranks_agree_to_stop_when_one_rank_sees_the_stop_file(world, tmp_path, who_sees):
    results = world.run(_agree, str(tmp_path), who_sees)
    assert [r[:2] for r in results] == [(False, True), (False, True)]
    ack = results[0][2]  # rank 0 acknowledges, next to its stop file, with the step
    assert ack and open(ack).read().strip() == "7" and results[1][2] is None


def test_train_stops_on_the_stop_file_with_status_3_and_the_rerun_resumes_from_its_checkpoint(
        tmp_path):
    cmd = [sys.executable, "-m", "mcore_rl.cli.main", "train", "configs/smoke.yaml",
           "--nproc", "1", "parallel.tp=1", "train.steps=4", f"logging.dir={tmp_path}"]
    stop_file = tmp_path / ".stop"
    stop_file.touch()
    env = dict(os.environ, MCORE_RL_STOP_FILE=str(stop_file))
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert first.returncode == 3, first.stderr[-3000:]
    assert "stopped on request after step 1" in first.stdout
    assert (tmp_path / ".stop.saved").read_text().strip() == "1"
    assert not (tmp_path / "smoke_summary.json").exists()

    stop_file.unlink()
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {tmp_path}/checkpoints/step_000001 after step 1" in second.stdout
    assert "step   1/4" not in second.stdout and "step   2/4" in second.stdout
    summary = json.loads((tmp_path / "smoke_summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["losses"]) == 4


def test_a_driver_without_ranks_of_its_own_acknowledges_its_saved_step(tmp_path):
    stop = StopSignal(stop_file=tmp_path / ".stop-9")
    assert not stop.requested_here()
    (tmp_path / ".stop-9").touch()  # what the batch shell's trap does
    assert stop.requested_here()
    assert stop.write_ack(4) == tmp_path / ".stop-9.saved"
    assert (tmp_path / ".stop-9.saved").read_text() == "4\n"
    assert StopSignal(stop_file="").write_ack(4) is None  # not under SLURM: nothing to tell
