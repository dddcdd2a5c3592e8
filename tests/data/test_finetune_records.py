"""Fine-tuning records: formats, configurable fields, chat templates, completion-only masks,
unusable records counted by reason, no usable record is one line; pairs stay together."""
import json

import pytest
import torch

from mcore_rl.config import RLConfig
from mcore_rl.data.finetune_batch import completion_batch, mismatched_batch, pair_batch, sides
from mcore_rl.data.finetune_records import kto_examples, pair_examples, sft_examples
from mcore_rl.data.finetune_sources import finetune_rows, toy_rows
from mcore_rl.data.toy_task import toy_tokenizer
from mcore_rl.errors import UsageError


def cfg(job="sft", **finetune) -> RLConfig:
    c = RLConfig()
    c.train.job = job
    for k, v in finetune.items():
        setattr(c.finetune, k, v)
    return c


TOK = toy_tokenizer()


def test_sft_prompt_completion_records_mask_only_the_completion_and_its_stop_token():
    (ex,), report = sft_examples([{"prompt": "3+4=", "completion": "7"}], cfg(), TOK, "t", 64)
    assert ex.prompt_ids == [TOK.bos_id] + TOK.encode("3+4=")
    assert ex.completion_ids == TOK.encode("7") + [TOK.eos_id]
    batch = completion_batch([ex], TOK.pad_id)
    assert batch["response_mask"].tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    assert report.used == 1 and not report.dropped


def test_unusable_records_are_counted_by_reason_and_left_out():
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1+2="}, {"completion": "3"},
            {"prompt": "1+3=", "completion": "  "}, {"prompt": "1+4=" * 10, "completion": "5"}]
    examples, report = sft_examples(rows, cfg(), TOK, "train.jsonl", 16)
    assert len(examples) == 1
    assert dict(report.dropped) == {"no 'completion' field": 1, "no 'prompt' field": 1,
                                    "empty 'completion'": 1, "over 16 tokens": 1}
    assert report.line() == ("train.jsonl: 1 usable record(s); left out: 1 empty 'completion', "
                             "1 no 'completion' field, 1 no 'prompt' field, 1 over 16 tokens")


def test_a_dataset_without_a_usable_record_is_one_line_naming_the_reasons_and_the_fix():
    with pytest.raises(UsageError) as err:
        pair_examples([{"prompt": "1+1=", "chosen": "2"}] * 3, cfg("dpo"), TOK, "pairs.jsonl", 64)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("pairs.jsonl has no usable record (3 no 'rejected' field)")
    assert "finetune.*_key" in msg


def test_field_names_are_configurable():
    rows = [{"q": "2+2=", "good": "4", "bad": "5"}]
    c = cfg("dpo", chosen_key="good", rejected_key="bad")
    c.data.prompt_key = "q"
    (pair,), _ = pair_examples(rows, c, TOK, "t", 64)
    assert pair.chosen_ids[:-1] == TOK.encode("4") and pair.rejected_ids[:-1] == TOK.encode("5")


def test_kto_labels_accept_booleans_numbers_and_words_and_refuse_others():
    rows = [{"prompt": "1+1=", "completion": "2", "label": v}
            for v in (True, 1, "desirable", False, 0, "undesirable", "maybe")]
    examples, report = kto_examples(rows, cfg("kto"), TOK, "t", 64)
    assert [e.desirable for e in examples] == [True, True, True, False, False, False]
    assert dict(report.dropped) == {"a 'label' that is neither desirable nor undesirable": 1}


def test_chat_messages_take_the_last_assistant_message_as_the_completion():
    from transformers import AutoTokenizer  # noqa: F401 (the HF path below needs it)

    from mcore_rl.data.tokenizer import HFTokenizer

    hf = HFTokenizer.__new__(HFTokenizer)
    hf.tok = TOK.to_hf()
    hf.tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    hf.eos_id, hf.pad_id = TOK.eos_id, TOK.pad_id
    calls = []
    real = hf.tok.apply_chat_template
    hf.tok.apply_chat_template = lambda msgs, **kw: calls.append(msgs) or real(msgs, **kw)
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    (ex,), _ = sft_examples([row], cfg(), hf, "t", 64)
    assert calls == [[{"role": "user", "content": "1+1="}]]  # the template saw the prompt turns
    assert ex.completion_ids == hf.encode("2") + [TOK.eos_id]
    bad = {"messages": [{"role": "assistant", "content": "2"}, {"role": "user", "content": "x"}]}
    _, report = sft_examples([row, bad], cfg(), hf, "t", 64)
    assert dict(report.dropped) == {"'messages' not ending with an assistant message": 1}


def test_a_pair_batch_interleaves_chosen_and_rejected_under_one_packing_unit():
    pairs, _ = pair_examples(toy_rows("dpo", "train", 20, 0)[:3], cfg("dpo"), TOK, "t", 64)
    batch = pair_batch(pairs, TOK.pad_id)
    assert batch["pack_unit"].tolist() == [1, 1, 2, 2, 3, 3]
    assert batch["chosen"].tolist() == [1, 0, 1, 0, 1, 0]
    # sides() matches by pair whatever the row order, and drops filler rows (unit 0)
    shuffled = batch.select([3, 0, 5, 2, 1, 4]).padded_to(8, batch.num_tokens)
    values = torch.tensor([21.0, 10.0, 31.0, 20.0, 11.0, 30.0, 0.0, 0.0])  # 10k + side
    chosen, rejected = sides(values, shuffled)
    assert chosen.tolist() == [10.0, 20.0, 30.0] and rejected.tolist() == [11.0, 21.0, 31.0]


def test_kto_mismatched_pairs_give_each_prompt_the_previous_examples_completion():
    examples, _ = kto_examples(toy_rows("kto", "train", 20, 0)[:3], cfg("kto"), TOK, "t", 64)
    mism = mismatched_batch(examples, TOK.pad_id)
    for i in range(3):
        row = mism["input_ids"][i][mism["attention_mask"][i].bool()].tolist()
        assert row == examples[i].prompt_ids + examples[i - 1].completion_ids


def test_builtin_rows_hold_out_the_validation_sums():
    train, val = toy_rows("dpo", "train", 20, 0), toy_rows("dpo", "val", 20, 0)
    assert len(train) == 80 and len(val) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    a, b = map(int, val[0]["prompt"][:-1].split("+"))
    assert val[0]["chosen"] == str(a + b) and val[0]["rejected"] == str(a + b + 1)
    kto = toy_rows("kto", "val", 20, 0)
    assert len(kto) == 40 and sum(r["label"] for r in kto) == 20


def test_file_rows_split_off_the_first_num_val_rows_for_validation(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}", "chosen": "1", "rejected": "2"}) + "\n"
                            for i in range(10)))
    c = cfg("dpo")
    c.data.source, c.data.path, c.data.num_val = "jsonl", str(path), 3
    assert [r["prompt"] for r in finetune_rows(c, "val")[0]] == ["0", "1", "2"]
    assert [r["prompt"] for r in finetune_rows(c, "train")[0]] == [str(i) for i in range(3, 10)]
    c.data.source = "reasoning_gym"
    with pytest.raises(UsageError, match="data.source=reasoning_gym cannot feed train.job=dpo"):
        finetune_rows(c, "train")
