"""Multi-turn episodes: the token ids and the mask of every response are exactly what the
engine generated turn by turn and what the calculator returned, and the limits hold."""
import re

import pytest
import torch

from mcore_rl.config.sections import ModelConfig
from mcore_rl.data.calculator_task import calculator_tokenizer
from mcore_rl.engines import SamplingConfig
from mcore_rl.engines.hf_engine import HFEngine
from mcore_rl.envs.calculator import CalculatorEnv, evaluate
from mcore_rl.envs.episodes import run_episodes
from mcore_rl.models.random_init import write_random_model

TOK = calculator_tokenizer()


def oracle_value(expression: str) -> str:
    """Python's own arithmetic on a digits-and-operators expression, else "?"."""
    if not re.fullmatch(r"[0-9]+([+*][0-9]+)*", expression):
        return "?"
    return str(eval(re.sub(r"\b0+(\d)", r"\1", expression)))


@pytest.mark.parametrize("text, value", [("23*7", 161), ("161+41", 202), ("2+3*4", 14),
                                          ("007", 7), ("", None), ("1+", None), ("*2", None),
                                          ("1**2", None), ("1 +2", None), ("?", None)])
def test_the_calculator_evaluates_only_arithmetic(text, value):
    assert evaluate(text) == value


def test_the_environment_answers_calls_and_scores_the_final_answer():
    env = CalculatorEnv(TOK)
    env.reset({"answer": "202"})
    assert env.stop_token_ids() == TOK.encode("]")
    step = env.step(TOK.encode("[23*7]"))
    assert TOK.decode(step.observation) == "161" and not step.done and step.reward == 0
    assert TOK.decode(env.step(TOK.encode("9[1+*]")).observation) == "?"
    assert TOK.decode(env.step(TOK.encode("12]")).observation) == "?"  # no opening bracket
    final = env.step(TOK.encode("202") + [TOK.eos_id])
    assert final.done and final.reward == 1.0
    assert env.step(TOK.encode("201") + [TOK.eos_id]).reward == 0.0


class RecordingEngine:
    """Passes generate calls to the engine and keeps (context, turn tokens, log-probs)."""

    def __init__(self, engine):
        self.engine, self.turns = engine, {}

    def generate(self, prompts, sampling, seeds=None):
        out = self.engine.generate(prompts, sampling, seeds=seeds)
        for s in out.samples:
            key = (tuple(prompts[s.prompt_index]), s.sample_index if sampling.n > 1 else 0)
            self.turns.setdefault(key, []).append((list(s.token_ids), list(s.logprobs)))
        return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("calc") / "model"
    arch = ModelConfig(num_layers=1, hidden_size=32, intermediate_size=64,
                              num_attention_heads=2, num_kv_heads=1, max_position_embeddings=64)
    write_random_model(arch, path, TOK.vocab_size, TOK.bos_id, TOK.eos_id, TOK.pad_id, seed=3)
    return HFEngine(str(path))


def test_episode_tokens_and_mask_are_the_engines_turns_and_the_tools_answers(engine):
    recorder = RecordingEngine(engine)
    prompts = [TOK.encode_prompt(f"{a}*{b}+{c}=", False) for a, b, c in
               [(23, 7, 41), (10, 2, 99), (55, 5, 12), (31, 9, 30), (99, 3, 11), (12, 4, 50)]]
    metas = [{"answer": "0"}] * len(prompts)
    stops = (TOK.eos_id, *TOK.encode("]"))
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, stop_token_ids=stops)
    rollouts = run_episodes(recorder, prompts, metas, sampling, lambda: CalculatorEnv(TOK),
                            eos_id=TOK.eos_id, max_turns=4, max_response_tokens=40,
                            seeds=list(range(len(prompts))), turn_seed=lambda p, s, t: 100 * t + 10 * p + s)
    batch = rollouts.to_batch(pad_id=TOK.pad_id)
    assert len(batch) == 24
    turns_seen = []
    for i, sample in enumerate(rollouts.samples):
        prompt = sample.prompt_token_ids
        mask = batch["response_mask"][i, len(prompt):len(prompt) + len(sample.token_ids)].tolist()
        logprobs = batch["rollout_logprobs"][i, len(prompt):len(prompt) + len(sample.token_ids)]
        assert batch["input_ids"][i, :len(prompt) + len(sample.token_ids)].tolist() == prompt + sample.token_ids
        assert batch["response_mask"][i, len(prompt) + len(sample.token_ids):].sum() == 0
        # walk the response: an engine turn (the recorded output for exactly this context),
        # then the calculator's answer to it (Python's arithmetic), and so on
        pos, turns, context = 0, 0, list(prompt)
        while pos < len(sample.token_ids):
            key = (tuple(context), sample.sample_index if turns == 0 else 0)
            recorded = recorder.turns[key]
            tokens, lps = next((t, lp) for t, lp in recorded if t == sample.token_ids[pos:pos + len(t)])
            assert mask[pos:pos + len(tokens)] == [1] * len(tokens)
            assert torch.allclose(logprobs[pos:pos + len(tokens)], torch.tensor(lps))
            pos, turns, context = pos + len(tokens), turns + 1, context + tokens
            if pos == len(sample.token_ids):
                break
            text = TOK.decode(tokens)
            assert text.endswith("]"), text  # only a call is answered
            answer = TOK.encode(oracle_value(text[text.rfind("[") + 1:-1]) if "[" in text else "?")
            assert sample.token_ids[pos:pos + len(answer)] == answer
            assert mask[pos:pos + len(answer)] == [0] * len(answer)
            assert logprobs[pos:pos + len(answer)].abs().sum() == 0
            pos, context = pos + len(answer), context + answer
        assert turns == sample.turns == batch.meta["turns"][i] <= 4
        assert len(sample.token_ids) <= 40
        last = sample.token_ids[-1]
        ended_by_eos = last == TOK.eos_id
        assert (sample.finish_reason == "stop") == ended_by_eos, (sample.finish_reason, TOK.decode(sample.token_ids))
        turns_seen.append(turns)
    assert max(turns_seen) >= 3 and min(turns_seen) == 1  # several turns happened, and single ones
