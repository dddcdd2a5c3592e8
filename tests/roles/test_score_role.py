"""The graph's reward role (`Score`): scores by the config's `RewardScorer`, whose metrics
ride in the batch's ``info`` into the step's metrics (`rollout_metrics`)."""
from types import SimpleNamespace

import torch

from mcore_rl.roles.score import Score
from mcore_rl.config import load_config
from mcore_rl.config.loader import config_to_dict
from mcore_rl.data.batch import Batch
from mcore_rl.rl.step_metrics import rollout_metrics


def test_the_scorer_metrics_reach_the_step_metrics_through_the_score_role():
    cfg = load_config(None, ["reward.weights.exact=1.0", "reward.failure_score=-1.0"])
    data = config_to_dict(cfg)
    data["reward"]["weights"]["tests.rewards.verifiers:fails_on_request"] = 0.5
    metas = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "fail": True},
             {"prompt": "3+3=", "answer": "6"}]
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1]])
    batch = Batch({"response_mask": mask, "truncated": torch.zeros(3, dtype=torch.bool)},
                  meta={"prompt_meta": metas, "response_text": ["2", "4", "7"]})
    role = Score(data)
    try:
        scored = role(batch)
    finally:
        role.close()
    assert scored["scores"].tolist() == [1.5, 0.5, 0.5]  # exact + 0.5 * (1, or -1 when failed)
    assert scored.info["reward/failures"] == 1
    assert "time/score" in scored.info
    state = SimpleNamespace(kl=SimpleNamespace(coef=0.0), cfg=cfg)
    metrics = rollout_metrics(state, scored)
    assert metrics["reward/exact/mean"] == 2 / 3
    assert metrics["reward/failures"] == 1.0 and metrics["reward/timeouts"] == 0.0
    assert abs(metrics["reward/mean"] - 2.5 / 3) < 1e-6
