"""The sbatch script and `mcore-rl launch slurm` checks that need no cluster."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.cli.main import main
from mcore_rl.launch.sbatch import SbatchRequest, render_sbatch

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "smoke.yaml")


def _request(**kw) -> SbatchRequest:
    base = dict(config=CONFIG, overrides=["train.steps=6"], run_dir="/shared/runs/a",
                workdir="/shared/work", python="/opt/venv/bin/python", nodes=2, procs_per_node=2)
    return SbatchRequest(**{**base, **kw})


def _directives(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_script_asks_for_requeue_appended_log_and_a_usr1_warning_before_the_time_limit():
    script = render_sbatch(_request(time="02:00:00", signal_lead_s=240, partition="batch",
                                    account="proj"))
    d = _directives(script)
    for expected in ["--nodes=2", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                     "--signal=B:USR1@240", "--time=02:00:00", "--partition=batch",
                     "--account=proj", "--output=/shared/runs/a/slurm-%j.log",
                     "--chdir=/shared/work", "--cpus-per-task=2"]:
        assert expected in d, (expected, d)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_script_runs_one_torchrun_per_node_with_rendezvous_from_the_allocation():
    script = render_sbatch(_request())
    assert 'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1' in script
    assert "-m torch.distributed.run" in script and "--nproc-per-node=2" in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port"' in script
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    assert "PYTHON=/opt/venv/bin/python" in script


def test_overrides_with_spaces_and_quotes_reach_the_ranks_unchanged():
    overrides = ["logging.dir=/runs/with space", "model.path=it's/here"]
    script = render_sbatch(_request(overrides=overrides))
    line = next(ln for ln in script.splitlines() if "mcore_rl.cli.main train" in ln)
    words = shlex.split(line.split("mcore_rl.cli.main", 1)[1].rstrip("& "))
    assert words == ["train", CONFIG, *overrides]


def test_gpu_nodes_get_gpus_and_nccl_defaults_cpu_nodes_get_cores_and_no_gpus():
    gpu = render_sbatch(_request(gpus_per_node=8, procs_per_node=8))
    assert "--gpus-per-node=8" in _directives(gpu)
    assert not any(d.startswith("--cpus-per-task") for d in _directives(gpu))
    assert 'TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"' in gpu
    cpu = render_sbatch(_request(threads_per_rank=3))
    assert "--cpus-per-task=6" in _directives(cpu) and "--cpus-per-task=6 " in cpu  # sbatch, srun
    assert 'CUDA_VISIBLE_DEVICES=""' in cpu and "NCCL" not in cpu
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-3}"' in cpu


@pytest.fixture
def recording_sbatch(tmp_path, monkeypatch):
    """A `sbatch` (and `sinfo`) on PATH that records any call: proves nothing was submitted."""
    bin_dir, record = tmp_path / "bin", tmp_path / "sbatch-called"
    bin_dir.mkdir()
    for name in ("sbatch", "sinfo"):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho {name} >> {record}\nexit 1\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def _launch(capsys, *args):
    code = main(["launch", "slurm", CONFIG, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_the_script_and_submits_nothing(capsys, tmp_path, recording_sbatch):
    code, out, err = _launch(capsys, f"logging.dir={tmp_path}/run", "--nodes", "2",
                             "--procs-per-node", "1", "--dry-run")
    assert code == 0, err
    assert out.startswith("#!/bin/bash") and f"logging.dir={tmp_path}/run" in out
    assert not recording_sbatch.exists()


def test_more_ranks_than_the_layout_allows_fail_in_one_line_before_submission(
        capsys, tmp_path, recording_sbatch):
    code, out, err = _launch(capsys, f"logging.dir={tmp_path}", "parallel.dp=1", "--nodes", "2",
                             "--procs-per-node", "2", "--partition", "debug")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "2 node(s) x 2 rank(s) = 4 ranks" in err and "tp*pp*dp = 2*1*1 = 2" in err
    code, out, err = _launch(capsys, "--nodes", "3", "--procs-per-node", "1")
    assert code == 2 and "world size 3 is not a multiple of tp*pp = 2" in err
    assert not recording_sbatch.exists() and out == ""


@pytest.mark.parametrize("flags", [[], ["--gpus-per-node", "1", "--procs-per-node", "1"]],
                         ids=["neither", "both"])
def test_launch_needs_exactly_one_of_gpus_or_procs_per_node(capsys, flags, recording_sbatch):
    code, _, err = _launch(capsys, "--nodes", "2", *flags)
    assert code == 2 and "exactly one of --gpus-per-node G" in err
    assert not recording_sbatch.exists()


def test_launch_without_sbatch_on_path_fails_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM client here
    code, out, err = _launch(capsys, f"logging.dir={tmp_path}/run", "--nodes", "2",
                             "--procs-per-node", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "sbatch and sinfo not found on PATH" in err and "--dry-run" in err
    assert not (tmp_path / "run").exists()


def test_launch_command_does_not_import_torch_on_the_login_node():
    probe = ("import sys; import mcore_rl.cli.launch, mcore_rl.launch.sbatch; "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


# --- Ray mode (`--ray DRIVER.py`)

DRIVER = str(REPO / "examples" / "slurm_grpo.py")


def _ray_launch(capsys, *args):
    code = main(["launch", "slurm", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ray_script_starts_a_head_and_workers_runs_the_driver_once_and_stops_ray_at_every_exit():
    script = render_sbatch(SbatchRequest(config="", run_dir="/shared/runs/r", workdir="/w",
                                         python="/opt/venv/bin/python", nodes=3, cpus_per_node=4,
                                         ray_driver=[DRIVER, "--steps", "4", "it's=here"]))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "--cpus-per-task=4" in _directives(script) and "--requeue" in _directives(script)
    head = script.index("ray_node start --head")
    workers = script.index('ray_node start --address "$RAY_ADDRESS"')
    wait = script.index("mcore_rl.flow.cluster wait --nodes")
    driver = script.index('"$PYTHON" "${driver[@]}" &')
    assert head < workers < wait < driver
    assert '--exclude="$head_node"' in script and '--nodelist="$head_node"' in script
    assert 'export RAY_ADDRESS="$head_ip:$head_port"' in script  # the head's address, explicit
    assert script.count("--num-cpus 4") == 2
    line = next(ln for ln in script.splitlines() if ln.startswith("driver=("))
    assert shlex.split(line[len("driver=("):-1]) == [DRIVER, "--steps", "4", "it's=here"]
    # Every path after the driver started goes through `finish` (stop Ray on every node).
    tail = script[driver:]
    assert tail.index("finish") < tail.index('if [ -f "$stop_ack" ]')
    commands = [ln for ln in script.splitlines() if not ln.lstrip().startswith("#")]
    assert "ray_node stop --job" in script  # its own Ray only: `ray stop` ends all on the host
    assert not [ln for ln in commands if "ray stop" in ln]


def test_ray_dry_run_prints_the_ray_script_and_submits_nothing(capsys, tmp_path, recording_sbatch):
    code, out, err = _ray_launch(capsys, "--nodes", "2", "--cpus-per-node", "2", "--run-dir",
                                 str(tmp_path / "run"), "--dry-run", "--ray", DRIVER, "--",
                                 "--steps", "3")
    assert code == 0, err
    assert "ray_node start --head" in out and f"RUN_DIR={tmp_path}/run" in out
    assert f"driver=({DRIVER} --steps 3)" in out
    assert not recording_sbatch.exists()


@pytest.mark.parametrize("args, message", [
    (["--ray", "nope.py"], "driver script nope.py not found"),
    (["--ray", "notes.txt"], "--ray runs a Python driver script or an mcore-rl train config"),
    (["--ray", CONFIG], "--ray runs RL jobs; train.job=smoke runs with --procs-per-node"),
    (["--ray", "missing.yaml"], "config missing.yaml not found"),
    (["--procs-per-node", "2", "--ray", DRIVER], "--procs-per-node does not apply to --ray jobs"),
    (["--nodes", "0", "--ray", DRIVER], "--nodes must be >= 1, got 0"),
    (["--cpus-per-node", "-1", "--ray", DRIVER], "--cpus-per-node must be >= 0, got -1"),
    (["--gpus-per-node", "0", "--ray", DRIVER], "--gpus-per-node must be >= 1, got 0"),
    ([CONFIG, "--nodes", "1", "--procs-per-node", "2", "--run-dir", "x"],
     "--run-dir and --cpus-per-node are for --ray jobs"),
], ids=["missing", "not-python", "not-rl", "missing-config", "procs-per-node", "no-nodes",
        "negative-cpus", "no-gpus", "not-ray"])
def test_bad_ray_requests_fail_in_one_line_before_submission(capsys, args, message,
                                                              recording_sbatch):
    code, out, err = _ray_launch(capsys, "--partition", "debug", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not recording_sbatch.exists() and out == ""
