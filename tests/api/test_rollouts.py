"""`Rollouts` and the prompts `RLTrainer.sample` takes (no ranks needed)."""
from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.api.rollouts import Rollouts
from mcore_rl.roles.generate import prompt_records
from mcore_rl.data.batch import Batch
from mcore_rl.errors import UsageError


def two_rows() -> Rollouts:
    batch = Batch.from_sequences([[5, 6, 7, 8], [5, 9]], [2, 1], pad_id=0,
                                 finish_reason=["stop", "length"], weight_version=[3, 3])
    lp = torch.zeros(batch["input_ids"].shape)
    lp[0, 2:4] = torch.tensor([-0.5, -0.25])
    lp[1, 1] = -1.0
    batch = batch.with_tensors(rollout_logprobs=lp)
    batch.meta["prompt_meta"] = [{"prompt": "ab", "answer": "1"}, {"prompt": "a", "answer": "2"}]
    batch.meta["response_text"] = ["cd", "e"]
    return Rollouts(batch)


def test_rollouts_read_tokens_text_logprobs_and_versions_per_row():
    r = two_rows()
    assert len(r) == 2
    assert r["prompt_ids"] == [[5, 6], [5]]
    assert r["response_ids"] == [[7, 8], [9]]
    assert r["logprobs"] == [[-0.5, -0.25], [-1.0]]
    assert r["prompt"] == ["ab", "a"] and r["meta"] == [{"answer": "1"}, {"answer": "2"}]
    assert r["finish_reason"] == ["stop", "length"] and r["weight_version"] == [3, 3]
    with pytest.raises(KeyError, match="not set yet"):
        r["reward"]
    r["reward"] = torch.tensor([1.0, 0.0])
    assert r["reward"] == [1.0, 0.0] and r.scores().tolist() == [1.0, 0.0]


@pytest.mark.parametrize("value, message", [
    ([1.0], "one value per row: got 1 for 2"),
    ([1.0, math.nan], r"\['reward'\]\[1\] = nan"),
    ([1.0, "x"], "finite number"),
])
def test_bad_rewards_are_refused_with_the_row(value, message):
    r = two_rows()
    with pytest.raises(UsageError, match=message):
        r["reward"] = value
    with pytest.raises(UsageError, match="set rollouts\\['reward'\\]"):
        r.scores()


def test_prompts_as_text_token_ids_or_dicts():
    text, ids, rich = prompt_records(["1+2=", [4, 5], {"prompt": "3+4=", "answer": "7"}])
    assert (text.prompt, text.token_ids) == ("1+2=", None)
    assert ids.token_ids == (4, 5)
    assert (rich.prompt, rich.meta) == ("3+4=", {"answer": "7"})
    for bad in ("1+2=", [], [3.5], [{"answer": "7"}]):
        with pytest.raises(UsageError):
            prompt_records(bad)
