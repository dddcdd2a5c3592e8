"""The job script and `mcore-rl launch slurm` checks that need no cluster: every job runs on
Ray (a head on the first node, a worker on every other), its driver ``mcore-rl train
CONFIG`` or a Python script."""
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
QUICK = str(REPO / "configs" / "quickstart.yaml")
DRIVER = str(REPO / "examples" / "slurm_grpo.py")


def _request(**kw) -> SbatchRequest:
    base = dict(driver=["-m", "mcore_rl.cli.main", "train", CONFIG, "train.steps=6"],
                run_dir="/shared/runs/a", workdir="/shared/work", python="/opt/venv/bin/python",
                nodes=3, cpus_per_node=4)
    return SbatchRequest(**{**base, **kw})


def _directives(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_script_asks_for_requeue_appended_log_and_a_usr1_warning_before_the_time_limit():
    script = render_sbatch(_request(time="02:00:00", signal_lead_s=240, partition="batch",
                                    account="proj"))
    d = _directives(script)
    for expected in ["--nodes=3", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                     "--signal=B:USR1@240", "--time=02:00:00", "--partition=batch",
                     "--account=proj", "--output=/shared/runs/a/slurm-%j.log",
                     "--chdir=/shared/work", "--cpus-per-task=4"]:
        assert expected in d, (expected, d)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_script_starts_a_head_and_workers_runs_the_driver_once_and_stops_ray_at_every_exit():
    script = render_sbatch(_request(driver=[DRIVER, "--steps", "4", "it's=here"]))
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


def test_gpu_nodes_get_gpus_for_slurm_and_ray_and_nccl_defaults_cpu_nodes_no_gpus():
    gpu = render_sbatch(_request(gpus_per_node=8, cpus_per_node=0))
    assert "--gpus-per-node=8" in _directives(gpu) and gpu.count("--num-gpus 8") == 2
    assert 'TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"' in gpu
    cpu = render_sbatch(_request(threads_per_rank=3))
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
    code = main(["launch", "slurm", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_config_runs_as_mcore_rl_train_on_ray_with_its_overrides_unchanged(
        capsys, tmp_path, recording_sbatch):
    overrides = [f"logging.dir={tmp_path}/with space", "train.steps=4"]
    code, out, err = _launch(capsys, CONFIG, *overrides, "--nodes", "2", "--dry-run")
    assert code == 0, err
    assert out.startswith("#!/bin/bash") and "ray_node start --head" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("driver=("))
    assert shlex.split(line[len("driver=("):-1]) == ["-m", "mcore_rl.cli.main", "train", CONFIG,
                                                     *overrides]
    assert f"RUN_DIR='{tmp_path}/with space'" in out
    assert not recording_sbatch.exists()


def test_a_driver_script_dry_run_prints_the_script_and_submits_nothing(capsys, tmp_path,
                                                                       recording_sbatch):
    code, out, err = _launch(capsys, "--nodes", "2", "--cpus-per-node", "2", "--run-dir",
                             str(tmp_path / "run"), "--dry-run", DRIVER, "--", "--steps", "3")
    assert code == 0, err
    assert f"RUN_DIR={tmp_path}/run" in out and f"driver=({DRIVER} --steps 3)" in out
    assert not recording_sbatch.exists()


def test_a_graph_larger_than_the_nodes_gpus_fails_in_one_line_before_submission(
        capsys, tmp_path, recording_sbatch):
    code, out, err = _launch(capsys, QUICK, f"logging.dir={tmp_path}", "parallel.tp=2",
                             "rollout.placement=separate", "rollout.replicas=2", "--nodes", "1",
                             "--gpus-per-node", "3", "--partition", "debug")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "1 node(s) x 3 GPU(s): the config needs 4 GPUs (trainer 2 + rollout #0 1 + " \
           "rollout #1 1)" in err
    assert not recording_sbatch.exists() and out == ""


def test_launch_without_sbatch_on_path_fails_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM client here
    code, out, err = _launch(capsys, CONFIG, f"logging.dir={tmp_path}/run", "--nodes", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "sbatch and sinfo not found on PATH" in err and "--dry-run" in err
    assert not (tmp_path / "run").exists()


def test_launch_command_does_not_import_torch_on_the_login_node():
    probe = ("import sys; import mcore_rl.cli.launch, mcore_rl.launch.sbatch; "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("args, message", [
    (["nope.py"], "driver script nope.py not found"),
    (["notes.txt"], "launch slurm runs an mcore-rl train config or a Python driver script"),
    (["missing.yaml"], "config missing.yaml not found"),
    (["--procs-per-node", "2", CONFIG], "--procs-per-node does not apply: the job's graph places"),
    (["--nodes", "0", DRIVER], "--nodes must be >= 1, got 0"),
    (["--cpus-per-node", "-1", DRIVER], "--cpus-per-node must be >= 0, got -1"),
    (["--gpus-per-node", "0", DRIVER], "--gpus-per-node must be >= 1, got 0"),
    ([CONFIG, "--run-dir", "x"], "--run-dir is a driver script's"),
    ([QUICK, "rollout.placement=fused", "train.schedule=async", "train.max_staleness=1"],
     "rollout.placement=fused runs rollout, reward and update in line"),
], ids=["missing", "not-python", "missing-config", "procs-per-node", "no-nodes",
        "negative-cpus", "no-gpus", "run-dir", "fused-async"])
def test_bad_requests_fail_in_one_line_before_submission(capsys, args, message, recording_sbatch):
    code, out, err = _launch(capsys, "--partition", "debug", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not recording_sbatch.exists() and out == ""


def test_every_ray_process_of_the_job_gives_up_on_a_dead_gcs_after_the_configured_time(
        capsys, tmp_path, recording_sbatch):
    code, out, err = _launch(capsys, CONFIG, f"logging.dir={tmp_path}",
                             "launch.ray_reconnect_timeout_s=7", "--nodes", "2", "--dry-run")
    assert code == 0, err
    exports = [ln for ln in out.splitlines() if ln.startswith("export RAY_gcs_rpc_server_reconnect")]
    assert exports == ['export RAY_gcs_rpc_server_reconnect_timeout_s='
                       '"${RAY_gcs_rpc_server_reconnect_timeout_s:-7}"'], exports
    head = out.index("ray_node start --head")
    assert out.index(exports[0]) < head  # the nodes' Ray and the driver inherit it
