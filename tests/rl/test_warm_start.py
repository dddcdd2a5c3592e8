"""The supervised warm start (`mcore_rl.rl.warm_start`) with a stand-in actor: what it trains
on, that the prompt stream is given back to RL, and the progress a long one reports."""
from dataclasses import dataclass, replace

from mcore_rl.config import load_config
from mcore_rl.data.prompts import PromptStream, load_prompt_records
from mcore_rl.data.toy_task import toy_tokenizer
from mcore_rl.rl.warm_start import PROGRESS_EVERY_S, warm_start


@dataclass
class _Result:
    loss: float
    applied: bool = True


class _Actor:
    """Records each batch; the loss of step k is 1 / k."""

    def __init__(self, clock: list[float], seconds_per_step: float):
        self.batches, self.lrs = [], []
        self.clock, self.seconds_per_step = clock, seconds_per_step

    def train_batch(self, batch, loss_fn, lr=None):
        self.batches.append(batch)
        self.lrs.append(lr)
        self.clock[0] += self.seconds_per_step
        return _Result(1.0 / len(self.batches))


@dataclass
class _State:
    cfg: object
    actor: _Actor
    tokenizer: object
    prompts: PromptStream


def _state(steps: int, seconds_per_step: float):
    cfg = load_config("configs/quickstart.yaml")
    cfg = replace(cfg, train=replace(cfg.train, warm_start_steps=steps, warm_start_batch=4))
    clock = [0.0]
    prompts = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    return _State(cfg, _Actor(clock, seconds_per_step), toy_tokenizer(), prompts), clock


def test_each_step_trains_on_prompts_with_answers_and_rl_gets_the_stream_from_its_start():
    state, clock = _state(steps=3, seconds_per_step=0.01)
    first = [r.prompt for r in PromptStream(load_prompt_records(state.cfg.data, "train"),
                                            state.cfg.data.seed).take(12)]
    losses = warm_start(state, clock=lambda: clock[0])
    assert losses == [1.0, 0.5, 1.0 / 3]
    assert state.actor.lrs == [state.cfg.train.warm_start_lr] * 3
    tok = state.tokenizer
    for k, batch in enumerate(state.actor.batches):
        assert len(batch) == 4
        for row in range(4):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            response = [t for t, m in zip(ids, batch["response_mask"][row].tolist()) if m]
            assert tok.decode(ids[:len(ids) - len(response)]) == first[4 * k + row]
            assert response[-1] == tok.eos_id and tok.decode(response[:-1]).isdigit()
    assert state.prompts.position == 0


def test_a_long_warm_start_reports_when_it_begins_and_every_so_often_a_short_one_only_begins():
    lines: list[str] = []
    steps, every = 10, PROGRESS_EVERY_S
    state, clock = _state(steps=steps, seconds_per_step=every / 3)
    warm_start(state, report=lines.append, clock=lambda: clock[0])
    assert lines[0].startswith(f"warm start: {steps} supervised steps of 4 prompts")
    # a report once the interval has passed (after steps 3, 6, 9), never after the last step
    assert lines[1:] == [f"warm start {k}/{steps} steps, loss {1.0 / k:.3f}" for k in (3, 6, 9)]

    lines.clear()
    state, clock = _state(steps=steps, seconds_per_step=0.01)
    warm_start(state, report=lines.append, clock=lambda: clock[0])
    assert len(lines) == 1 and lines[0].startswith("warm start: ")
