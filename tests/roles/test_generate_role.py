"""The rollout role of the synchronous and one-step-off schedules waits while its engine
sleeps (colocated: the trainer has the devices for its update) and generates once woken."""
from __future__ import annotations

import threading
from pathlib import Path

from mcore_rl.roles.generate import Generate
from mcore_rl.config import load_config
from mcore_rl.data.toy_task import toy_tokenizer
from mcore_rl.engines.hf_engine import HFEngine
from mcore_rl.rl.setup import write_initial_model

REPO = Path(__file__).resolve().parents[2]


def test_a_generation_waits_for_the_engine_to_wake(tmp_path):
    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      ["rollout.engine=hf", f"logging.dir={tmp_path}", "rollout.n_samples_per_prompt=2"])
    role = Generate.__new__(Generate)  # without a launch: the engine is not published
    role.cfg, role.tokenizer, role.lock, role.calls = cfg, toy_tokenizer(), threading.RLock(), 0
    role.engine = HFEngine(str(write_initial_model(cfg)))
    role.engine.sleep()
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=role({"step": 1, "prompts": ["1+2=", "3+4="]})))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and not out  # a generation now would raise: it waits instead
    role.engine.wake()
    worker.join(60)
    assert not worker.is_alive()
    assert len(out["batch"]) == 4 and out["batch"].meta["weight_version"] == [0] * 4
