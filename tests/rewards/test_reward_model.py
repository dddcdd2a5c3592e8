"""``reward.name: reward_model``: texts scored by a reward model on Megatron ranks equal HF's
``AutoModelForSequenceClassification`` scores of the same texts (its own tokenizer and chat
template, pooled at the last non-pad token) at TP1, TP2 and PP2, from the HF directory and
from a converted checkpoint; bad input is refused in one line before any rank starts; the
scorer of a process refuses to run it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_rl.cli.main import main
from mcore_rl.config import RewardConfig
from mcore_rl.errors import UsageError
from mcore_rl.rewards import RewardScorer
from tests.models.tiny_hf import build_tiny_hf_model
from tests.world import shared_world

REPO = Path(__file__).resolve().parents[2]
QUICK = str(REPO / "configs" / "quickstart.yaml")
ATOL = 1e-4
LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp) in a world of 2: TP1 is DP2
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789+=:?! "
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
PROMPTS = ["3+4=", "what is 2+2?", "9+9=", "hi"]
RESPONSES = ["7", "it is 4", "", "hello there, friend"]


def save_reward_model(out: Path, chat: bool, pad_is_eos: bool) -> Path:
    """A random Llama ``*ForSequenceClassification`` and a character tokenizer (ids 0-2:
    pad, bos, eos), with the chat template `CHAT` (every turn ends with EOS) or none; pad is
    EOS (as in SmolLM2) or a token of its own."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(ALPHABET)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<eos>" if pad_is_eos else "<pad>")
    if chat:
        tok.chat_template = CHAT
    model = build_tiny_hf_model("llama-untied", head="score", seed=3)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_scores(path: Path, chat: bool) -> torch.Tensor:
    """HF's scores: texts tokenised as the documented rule says, right-padded with the pad
    token, pooled by the HF model itself."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": p},
                                          {"role": "assistant", "content": r}], tokenize=False)
                 for p, r in zip(PROMPTS, RESPONSES)]
        enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    else:
        ids = [tok(p).input_ids + tok(r, add_special_tokens=False).input_ids + [tok.eos_token_id]
               for p, r in zip(PROMPTS, RESPONSES)]
        enc = tok.pad({"input_ids": ids}, return_tensors="pt")
    model = AutoModelForSequenceClassification.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**enc).logits[:, 0]


def _scores_at_layouts(rank, world_size, paths: list[str]) -> dict:
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.rl.reward_model import build_reward_model

    out = {}
    for tp, pp in LAYOUTS:
        ctx = initialize_parallel(tp=tp, pp=pp)
        for path in paths:
            model = build_reward_model(RewardConfig(name="reward_model", reward_model_path=path),
                                       ctx)
            out[(tp, pp, Path(path).name)] = model.score(PROMPTS, RESPONSES)[0]
        destroy_parallel()
    return out


@pytest.mark.parametrize("chat, pad_is_eos", [(True, True), (False, False)],
                         ids=["chat-template-pad-is-eos", "plain-own-pad"])
def test_scores_equal_hf_sequence_classification_at_tp1_tp2_pp2(tmp_path, chat, pad_is_eos):
    from mcore_rl.convert import convert_hf_to_mcore

    path = save_reward_model(tmp_path / "rm", chat, pad_is_eos)
    converted = convert_hf_to_mcore(path, tmp_path / "mcore", tp=2, progress=False)
    reference = hf_scores(path, chat)
    per_rank = shared_world(2).run(_scores_at_layouts, [str(path), str(converted)])
    assert len(per_rank[0]) == 2 * len(LAYOUTS)
    for rank, results in enumerate(per_rank):
        for (tp, pp, source), scores in results.items():
            diff = (scores - reference).abs().max().item()
            assert diff <= ATOL, f"{source} TP{tp} PP{pp} rank {rank}: |score - HF| = {diff:.3g}"


def test_pad_equal_to_eos_pools_the_token_before_the_trailing_eos(tmp_path):
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rewards.reward_model import encode_exchanges, resolve_reward_model

    source = resolve_reward_model(str(save_reward_model(tmp_path / "rm", True, True)))
    tokenizer = load_tokenizer(source.tokenizer_dir)
    assert source.pad_id == tokenizer.eos_id == 2
    (ids,), cut = encode_exchanges(tokenizer, ["3+4="], ["7"], source.pad_id, 64)
    full = tokenizer.tok.apply_chat_template([{"role": "user", "content": "3+4="},
                                              {"role": "assistant", "content": "7"}])
    full = full["input_ids"] if hasattr(full, "keys") else full
    assert full[-1] == 2 and ids == list(full[:-1]) and tokenizer.decode(ids[-1:]) == "7"
    (ids,), cut = encode_exchanges(tokenizer, ["3+4="], ["7"], source.pad_id, 5)
    assert cut == 1 and len(ids) == 5 and tokenizer.decode(ids[-1:]) == "7"  # keeps the end


def test_a_reward_scorer_refuses_the_reward_model_in_one_line():
    with pytest.raises(UsageError, match="scores with a worker group of its own") as err:
        RewardScorer.from_config(RewardConfig(name="reward_model"))
    assert "\n" not in str(err.value)


def _hf_config(path: Path, architecture: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": "llama", "vocab_size": 32,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_labels": 1}))
    return path


@pytest.mark.parametrize("argv, message, fix", [
    (["reward.name=reward_model"], "reward.name=reward_model needs reward.reward_model_path",
     "an HF *ForSequenceClassification directory"),
    (["reward.reward_model_path={d}/missing"],
     "reward.reward_model_path={d}/missing does not exist",
     "give an HF *ForSequenceClassification directory"),
    (["reward.reward_model_path={d}/causal"], "is a causal LM (LlamaForCausalLM) with no scalar "
                                              "score head", "give a reward model"),
    (["reward.reward_model_path={d}/rm", "reward.rm_tp=3"], "TP 3 does not divide "
                                                            "num_attention_heads 4",
     "choose a layout that divides it"),
    (["reward.reward_model_path={d}/rm", "reward.val_reward=exactt"],
     "reward.val_reward: unknown reward 'exactt'", "did you mean 'exact'"),
    (["reward.reward_model_path={d}/rm", "reward.rm_pp=0"], "reward.rm_pp must be >= 1", "set"),
], ids=["no-path", "missing-path", "causal-lm", "tp-3", "val-reward", "pp-0"])
def test_bad_reward_model_input_is_one_line_before_any_rank(argv, message, fix, tmp_path,
                                                             capsys, no_rank_starts):
    d = tmp_path
    _hf_config(d / "causal", "LlamaForCausalLM")
    _hf_config(d / "rm", "LlamaForSequenceClassification")
    argv = ["reward.name=reward_model", *(a.format(d=d) for a in argv), f"logging.dir={d}/run"]
    assert main(["train", QUICK, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(d=d) in err[0] and fix in err[0], err
    assert not (d / "run").exists()


def test_roles_fused_into_the_trainer_refuse_the_reward_model_in_one_line(tmp_path, capsys,
                                                                          monkeypatch,
                                                                          no_rank_starts):
    assert main(["train", QUICK, "reward.name=reward_model", "rollout.placement=fused",
                 f"logging.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.placement=fused (every role in the trainer's ranks) does " \
        "not start" in err[0], err
    monkeypatch.setenv("WORLD_SIZE", "1")  # under torchrun: every role fused, without Ray
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert main(["train", QUICK, "reward.name=reward_model", f"logging.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "under torchrun or srun every role runs fused" in err[0], err
    assert "mcore-rl launch slurm CONFIG" in err[0]
    assert not (tmp_path / "run").exists()
