"""GPU placement on Ray's logical GPUs, two simulated nodes of 6 GPUs: what each rank and
engine worker is given (``ray.get_gpu_ids()``, ``CUDA_VISIBLE_DEVICES``) and the device index
the binding code returns, from light probe actors placed exactly as ranks are
(`mcore-rl placement`). Multi-GPU placement with real GPUs and NCCL has not run here."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MCORE_RL = str(Path(sys.executable).parent / "mcore-rl")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("placement") / "cases.json"
    proc = subprocess.run([sys.executable, "-m", "tests.flow.placement_cases", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def by(rows, *keys):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def test_every_process_binds_the_one_gpu_ray_gave_it(cases):
    for name in ("separate_two_engines", "colocated_two_engines", "separate_one_engine"):
        for row in cases[name]["rows"]:
            assert row["cuda_visible_devices"] == str(row["gpu"]), (name, row)
            assert row["device_index"] == 0, (name, row)


def test_tp2_pp2_dp2_with_two_separate_tp2_engines(cases):
    rows = cases["separate_two_engines"]["rows"]
    trainer = [r for r in rows if r["role"] == "trainer"]
    engines = [r for r in rows if r["role"] == "rollout"]
    assert sorted(r["rank"] for r in trainer) == list(range(8))
    assert sorted((r["replica"], r["rank"]) for r in engines) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({(r["node_id"], r["gpu"]) for r in rows}) == 12  # nothing shared
    for group in by(trainer, "dp").values():  # a model replica (TP group and its stages) per node
        assert len({r["node_id"] for r in group}) == 1
    assert len({g[0]["node_id"] for g in by(trainer, "dp").values()}) == 2  # DP spread
    for group in by(engines, "replica").values():
        assert len({r["node_id"] for r in group}) == 1


def test_colocated_engines_share_the_trainers_gpus(cases):
    rows = cases["colocated_two_engines"]["rows"]
    trainer = {(r["node_id"], r["gpu"]): r["rank"] for r in rows if r["role"] == "trainer"}
    engines = [r for r in rows if r["role"] == "rollout"]
    assert len(engines) == 4 and all(r["shared"] for r in engines)
    for r in engines:
        assert trainer[(r["node_id"], r["gpu"])] == 2 * r["replica"] + r["rank"]
    assert len({(r["node_id"], r["gpu"]) for r in rows}) == 8


def test_one_separate_engine_and_a_cluster_too_small_for_three(cases):
    assert len(cases["separate_one_engine"]["rows"]) == 10
    assert "needs 14 GPUs" in cases["too_small"]["error"]
    assert "but the cluster has 12 (2 node(s) x 6, 6)" in cases["too_small"]["error"]


def test_a_launched_engine_sees_all_its_gpus_and_a_one_rank_group_binds_its_own(cases):
    launched = cases["launched"]
    engine, trainer = launched["engine"], launched["trainer"]
    # the engine's process sits in its first bundle; its workers see both bundles' GPUs
    visible = engine["cuda_visible_devices"].split(",")
    assert len(visible) == 2 and len(set(visible)) == 2, engine
    assert visible[0] == engine["gpu_ids"][0], engine
    # the one rank took a bundle of its own: another GPU, not the engine's
    assert len(trainer["gpu_ids"]) == 1 and trainer["cuda_visible_devices"] == trainer["gpu_ids"][0]
    assert trainer["node"] != engine["node"] or trainer["gpu_ids"][0] not in visible, launched


def test_the_cli_prints_the_map_and_writes_it_as_json(tmp_path):
    out = tmp_path / "map.json"
    proc = subprocess.run([MCORE_RL, "placement", "configs/quickstart.yaml", "parallel.tp=2",
                           "rollout.placement=separate", "--nodes", "1", "--gpus-per-node", "3",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["role"], r["rank"]) for r in rows] == [("trainer", 0), ("trainer", 1), ("rollout", 0)]
    assert {k for k in rows[0]} >= {"role", "replica", "rank", "node", "gpu", "tp", "pp", "dp"}
    assert "binds cuda:0" in proc.stdout


def test_the_cli_refuses_a_cluster_too_small_in_one_line(tmp_path):
    proc = subprocess.run([MCORE_RL, "placement", "configs/quickstart.yaml", "parallel.tp=2",
                           "rollout.placement=separate", "--nodes", "1", "--gpus-per-node", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("mcore-rl placement: error: the config needs 3 GPUs"), proc.stderr
    assert "Traceback" not in proc.stderr
