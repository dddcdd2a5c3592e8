"""A DPO run resumed from its step-3 checkpoint logs the same metrics at steps 4-6 as an
uninterrupted run: the directory is what a run killed during step 5 or 6 leaves (the
newest checkpoint, step 6, never written). The warm start made the reference, so the
checkpoint carries it: a reference rebuilt from the initial model would change every loss."""
import json
import shutil
from pathlib import Path

import pytest

from tests.finetune.test_jobs_learn import _run
from tests.world import shared_world

OVERRIDES = ["train.steps=6", "checkpoint.save_every=3", "train.val_every=2",
             "train.warm_start_steps=20"]


def test_resumed_dpo_run_logs_the_same_metrics_as_an_uninterrupted_one(tmp_path):
    world = shared_world(1)
    full = tmp_path / "full"
    history = world.run(_run, "dpo_quickstart.yaml", OVERRIDES + [f"logging.dir={full}"])[0]
    killed = tmp_path / "killed"
    shutil.copytree(full, killed)
    shutil.rmtree(killed / "checkpoints" / "step_000006")
    (killed / "checkpoints" / "latest").write_text("step_000003")
    resumed = world.run(_run, "dpo_quickstart.yaml", OVERRIDES + [f"logging.dir={killed}"])[0]
    assert [h["step"] for h in resumed] == [h["step"] for h in history] == [0, 1, 2, 3, 4, 5, 6]
    for a, b in zip(history, resumed):
        timing = {k for k in a if k.startswith(("time/", "perf/"))}
        assert {k: v for k, v in b.items() if k not in timing} == pytest.approx(
            {k: v for k, v in a.items() if k not in timing}, rel=1e-6, abs=1e-7), a["step"]
    assert history[4]["loss"] != pytest.approx(0.693147, abs=1e-4)  # the policy has moved
    state = json.loads((killed / "checkpoints" / "step_000006" / "run_state.json").read_text())
    assert state["step"] == 6 and len(state["losses"]) == 6
    assert (killed / "checkpoints" / "step_000006" / "reference").is_dir()
