"""`mcore-rl launch slurm` on a real SLURM cluster started on this machine.

The cluster (`mcore_rl.launch.slurm_cluster`): munged, slurmctld and two slurmd daemons
emulating nodes n1 and n2; installed with apt-get when missing; only the daemons started
here are stopped, also when a test fails. Every job runs on a Ray cluster of both nodes
(a head on n1, a worker on n2), its driver ``mcore-rl train CONFIG`` (the RL graph with the
asynchronous schedule at TP2) or a script (`RLTrainer` GRPO); ranks are spread so that every
step crosses the two nodes. As the two nodes share this host, their ranks are told apart by
Ray node id, and what a Ray job leaves behind by the processes naming its nodes' temp dirs.

Requeue delay on Slurm 22.05.8: a requeued job may start again only after the job credential
lifetime (``AuthInfo=...,cred_expire=N``, default 120 s) and then waits for the next
scheduling pass (``sched_interval``, default 60 s); with those defaults we measured 178 s
from ``scontrol requeue`` to running again. This cluster sets cred_expire=5 (the smallest
accepted) and sched_interval=2: measured 6-8 s. The preemption test prints its measurement
(run pytest with -s to see it). On the 2-core development machine, shared with other work,
the Ray job of 6 GRPO steps completed 19-22 s after submission, its preempted run (start,
stop after a step, checkpoint, requeue, start again on clean nodes, resume, finish) 46-51 s
after (the test's wall time), the failing flow launch 15 s. Preemption is tested once, on
the script driver: the batch script that traps the signal and requeues is the same for
every driver, and ``mcore-rl train`` stopping on the stop file and resuming from its
checkpoint is tested in tests/launch/test_stop_signal.py.
"""
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.launch.slurm_cluster import LocalSlurmCluster

REPO = Path(__file__).resolve().parents[2]
MCORE_RL = str(Path(sys.executable).parent / "mcore-rl")  # the venv's, by absolute path
STEPS = 8
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster():
    c = LocalSlurmCluster(cred_expire_s=5)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)


def launch(cluster, run_dir, *args):
    return subprocess.run(
        [MCORE_RL, "launch", "slurm", "configs/smoke.yaml", f"train.steps={STEPS}",
         f"logging.dir={run_dir}", *args], capture_output=True, text=True, cwd=REPO,
        env=cluster.env, timeout=120)


def wait_for(cluster, job_id, done, what, timeout_s=JOB_TIMEOUT_S):
    """Poll ``scontrol show job`` until ``done(info)``; returns (info, seconds waited)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        info = cluster.job_info(job_id)
        if done(info):
            return info, time.monotonic() - t0
        if info["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job_id}: no {what} (last {info['JobState']}); "
                         f"{cluster.tail_logs()}")


def next_job_id(cluster) -> str:
    out = cluster.run(["scontrol", "show", "config"]).stdout
    return re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", out).group(1)


def test_bad_requests_fail_in_one_line_and_nothing_reaches_the_queue(cluster, tmp_path):
    before = next_job_id(cluster)
    cases = [
        ([], "no partition given and the cluster has no default partition; add --partition "
             "NAME (one of: debug)"),
        (["--partition", "gpu"], "partition 'gpu' does not exist on this cluster; choose one "
                                 "of: debug"),
        (["--partition", "debug", "--gpus-per-node", "1"], "2 node(s) x 1 GPU(s): trainer: a TP "
                                                           "group of 2 GPUs must lie on one node"),
    ]
    for extra, message in cases:
        proc = launch(cluster, tmp_path, "--nodes", "2", *extra)
        assert proc.returncode == 2, (extra, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert next_job_id(cluster) == before
    assert not list(tmp_path.glob("slurm-*"))


# --- Ray mode: a driver script (examples/slurm_grpo.py, an RLTrainer GRPO run at TP2 with the
# hf engine) on a Ray cluster of both nodes, its ranks spread over them.

RAY_STEPS = 6
RAY_DRIVER = ["--steps", str(RAY_STEPS), "--prompts-per-step", "4", "rollout.engine=hf",
              "rollout.n_samples_per_prompt=4", "train.warm_start_steps=10", "train.val_every=0",
              "data.num_val=4"]


def submit_ray(cluster, run_dir) -> str:
    proc = subprocess.run(
        [MCORE_RL, "launch", "slurm", "--nodes", "2", "--cpus-per-node", "2", "--partition",
         "debug", "--run-dir", str(run_dir), "examples/slurm_grpo.py", "--",
         *RAY_DRIVER], capture_output=True, text=True, cwd=REPO, env=cluster.env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


def ray_finished(cluster, job_id, run_dir):
    info, seconds = wait_for(cluster, job_id, lambda i: i["JobState"] == "COMPLETED", "completion")
    log = (run_dir / f"slurm-{job_id}.log").read_text()
    assert info["ExitCode"] == "0:0", log[-3000:]
    return log, seconds


def driver_starts(run_dir) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("driver-*.json"),
                                                      key=lambda p: int(p.stem.split("-")[1]))]


def rl_metrics(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {r["step"]: r for r in rows if "actor/loss" in r}


def assert_no_ray_left(job_id, starts):
    from mcore_rl.launch.ray_node import node_processes, temp_dir

    for node in ("n1", "n2"):
        assert not temp_dir(job_id, node).exists(), temp_dir(job_id, node)
        assert not node_processes(temp_dir(job_id, node)), node
    pids = [r["pid"] for s in starts for r in s["ranks"]]
    assert pids and not [p for p in pids if Path(f"/proc/{p}").exists()], pids


@pytest.fixture(scope="module")
def ray_uninterrupted(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray")
    job_id = submit_ray(cluster, run_dir)
    return (run_dir, job_id, *ray_finished(cluster, job_id, run_dir))


def test_ray_job_spreads_the_drivers_ranks_over_both_nodes_and_stops_its_ray(ray_uninterrupted):
    run_dir, job_id, log, seconds = ray_uninterrupted
    assert re.search(r"Ray head 127\.0\.0\.1:\d+ on n1", log), log
    assert "mcore_rl.flow.cluster: 2 Ray nodes up" in log
    for node in ("n1", "n2"):  # each node its own temp dir, stopped at the end
        assert f"--temp-dir=/tmp/mcore-rl-ray-{job_id}-{node}" in log
        assert f"ray_node: {node}: stopped Ray of job {job_id}" in log
    [start] = driver_starts(run_dir)
    nodes = [r["node"] for r in start["ranks"]]
    assert len(nodes) == 2 and nodes[0] != nodes[1], start  # TP2: one rank on each Ray node
    assert sorted(rl_metrics(run_dir)) == list(range(1, RAY_STEPS + 1))
    assert f"driver: finished step {RAY_STEPS}" in log and "driver exited with status 0" in log
    assert_no_ray_left(job_id, [start])
    print(f"2-node Ray job completed {seconds:.1f}s after submission")


def test_ray_job_preempted_checkpoints_requeues_on_clean_nodes_and_resumes(
        cluster, tmp_path, ray_uninterrupted):
    job_id = submit_ray(cluster, tmp_path)
    log_path = tmp_path / f"slurm-{job_id}.log"
    # Signal once the driver has trained a step: it stops at the next step boundary.
    wait_for(cluster, job_id, lambda i: log_path.exists() and re.search(r"\bstep 1[/:]", log_path.read_text()),
             "first step")
    cluster.run(["scancel", "--batch", "--signal=USR1", job_id])  # what --signal=B:USR1@T sends
    wait_for(cluster, job_id, lambda i: i["Restarts"] == "1", "requeue")
    _, requeue_delay = wait_for(
        cluster, job_id, lambda i: i["Restarts"] == "1" and i["JobState"] in ("RUNNING", "COMPLETED"),
        "restart")
    log, _ = ray_finished(cluster, job_id, tmp_path)

    stopped = int(re.search(r"driver: stopped on request after step (\d+)", log).group(1))
    assert 1 <= stopped < RAY_STEPS, log
    first_run, second_run = log.split("start 1] ", 1)
    assert f"checkpoint saved after step {stopped}; requeueing" in first_run
    assert "Ray stopped on every node" in first_run  # before the requeue
    for node in ("n1", "n2"):  # the requeued job's Ray nodes start clean
        assert f"ray_node: {node}: 0 processes left from an earlier start of job {job_id}" \
            in second_run, second_run
    assert f"resumed from {tmp_path}/checkpoints/step_{stopped:06d}" in second_run
    starts = driver_starts(tmp_path)
    assert [s["first_step"] for s in starts] == [1, stopped + 1], starts
    for start in starts:
        assert len({r["node"] for r in start["ranks"]}) == 2, start
    metrics = rl_metrics(tmp_path)
    assert sorted(metrics) == list(range(1, RAY_STEPS + 1))  # every step once, across runs
    assert_no_ray_left(job_id, starts)
    # The same prompts per step and the restored state: the steps match the uninterrupted run.
    reference = rl_metrics(ray_uninterrupted[0])
    for key in ("reward/mean", "actor/loss"):
        assert [metrics[s][key] for s in sorted(metrics)] == pytest.approx(
            [reference[s][key] for s in sorted(metrics)], rel=1e-5, abs=1e-7), key
    print(f"requeue delay (requeued -> running again): {requeue_delay:.1f}s")


def test_ray_job_failing_driver_worker_group_fills_both_nodes_and_still_stops_ray(
        cluster, tmp_path):
    proc = subprocess.run(
        [MCORE_RL, "launch", "slurm", "--nodes", "2", "--cpus-per-node", "2", "--partition",
         "debug", "--run-dir", str(tmp_path), "tests/launch/ray_flow_driver.py", "--",
         "--fail"], capture_output=True, text=True, cwd=REPO, env=cluster.env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    info, _ = wait_for(cluster, job_id, lambda i: i["JobState"] == "FAILED", "failure")
    log = (tmp_path / f"slurm-{job_id}.log").read_text()
    assert info["ExitCode"] == "1:0" and info["Restarts"] == "0", log[-3000:]
    assert "driver: launch done, 1 item(s)" in log and "driver exited with status 1" in log
    assert "Ray stopped on every node" in log
    ranks = sorted((json.loads(line) for line in (tmp_path / "ranks.jsonl").read_text()
                    .splitlines()), key=lambda r: r["rank"])
    nodes = [r["node"] for r in ranks]
    # 4 ranks on 2 nodes: contiguous blocks of two (a TP2 group per node), not interleaved.
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    assert_no_ray_left(job_id, [{"ranks": ranks}])


def test_the_async_rl_graph_runs_over_both_nodes_and_leaves_no_ray_behind(cluster, tmp_path):
    """``mcore-rl launch slurm CONFIG``: ``mcore-rl train`` is the driver of the RL graph with
    the asynchronous schedule, its trainer ranks placed over the two Ray nodes."""
    from mcore_rl.launch.ray_node import node_processes, temp_dir

    proc = subprocess.run(
        [MCORE_RL, "launch", "slurm", "configs/quickstart.yaml", "--nodes", "2",
         "--cpus-per-node", "2", "--partition", "debug", "parallel.tp=2",
         "train.schedule=async", "train.max_staleness=1", "rollout.placement=separate",
         "rollout.engine=hf", "train.steps=3", "train.warm_start_steps=10", "train.val_every=0",
         "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "logging.progress_bar=false",
         "checkpoint.save_every=0", f"logging.dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt"],
        capture_output=True, text=True, cwd=REPO, env=cluster.env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    assert f"log:    {tmp_path}/slurm-{job_id}.log" in proc.stdout
    log, _ = ray_finished(cluster, job_id, tmp_path)
    assert "mcore-rl: 2 trainer rank(s), layout TP2xPP1xDP1, on 2 Ray node(s)" in log, log
    assert "separate, async on Ray" in log, log
    metrics = rl_metrics(tmp_path)
    assert sorted(metrics) == [1, 2, 3]
    assert all(m["rollout/token_staleness_max"] <= 1 for m in metrics.values())
    assert "driver exited with status 0" in log and "Ray stopped on every node" in log
    for node in ("n1", "n2"):
        assert not temp_dir(job_id, node).exists() and not node_processes(temp_dir(job_id, node))
