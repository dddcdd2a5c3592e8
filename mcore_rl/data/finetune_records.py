"""Records of the supervised and preference jobs, tokenized: SFT completions, DPO/RM pairs,
KTO labelled completions.

Formats (field names from ``finetune`` and ``data.prompt_key``):
- sft: ``prompt, completion``, or chat ``messages`` (the last message is the completion);
- dpo, rm: ``prompt, chosen, rejected`` (rm: optionally a margin field);
- kto: ``prompt, completion, label`` (true/1/"desirable" or false/0/"undesirable").

The prompt goes through the tokenizer's chat template (``data.apply_chat_template``); a
completion is its text's tokens and the end-of-sequence token, and only completion tokens
are trained on. A record that cannot be used (a missing field, an empty completion, more
than ``max_length`` tokens, a label that is neither) is counted by reason and left
out (`RecordReport`); a dataset with no usable record is a one-line `UsageError`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mcore_rl.config import RLConfig
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.errors import UsageError

DESIRABLE = {True, 1, "1", "true", "desirable", "good", "correct"}
UNDESIRABLE = {False, 0, "0", "false", "undesirable", "bad", "incorrect"}


@dataclass
class Completion:
    """One prompt and one completion (sft; kto with ``desirable``)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool = True


@dataclass
class Pair:
    """One prompt with a preferred and a dispreferred completion (dpo, rm)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0


@dataclass
class RecordReport:
    """How many records were used, and how many were left out for which reason."""

    name: str
    used: int = 0
    dropped: Counter = field(default_factory=Counter)

    def line(self) -> str:
        left = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items()))
        return f"{self.name}: {self.used} usable record(s)" + (f"; left out: {left}" if left else "")


class _Encoder:
    def __init__(self, cfg: RLConfig, tokenizer: Tokenizer, max_length: int):
        self.cfg, self.f, self.tok = cfg, cfg.finetune, tokenizer
        self.chat = cfg.data.apply_chat_template
        self.max_length = max_length

    def prompt(self, row: dict) -> list[int] | str:
        key = self.cfg.data.prompt_key
        if key not in row:
            return f"no '{key}' field"
        return self.tok.encode_prompt(str(row[key]), self.chat)

    def completion(self, row: dict, key: str) -> list[int] | str:
        if key not in row or row[key] is None:
            return f"no '{key}' field"
        text = str(row[key])
        if not text.strip():
            return f"empty '{key}'"
        return self.tok.encode(text) + [self.tok.eos_id]

    def conversation(self, row: dict) -> tuple[list[int], list[int]] | str:
        messages = row[self.f.messages_key]
        if not isinstance(messages, list) or len(messages) < 2:
            return f"'{self.f.messages_key}' with fewer than 2 messages"
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return f"'{self.f.messages_key}' not ending with an assistant message"
        if not str(last.get("content", "")).strip():
            return "empty completion"
        prompt = self.tok.encode_conversation(messages[:-1], self.chat)
        return prompt, self.tok.encode(str(last["content"])) + [self.tok.eos_id]

    def too_long(self, prompt: list[int], *completions: list[int]) -> bool:
        return len(prompt) + max(len(c) for c in completions) > self.max_length


def _finish(report: RecordReport, examples: list, where: str) -> list:
    if not examples:
        reasons = "; ".join(f"{n} {why}" for why, n in sorted(report.dropped.items())) or "it is empty"
        raise UsageError(f"{where} has no usable record ({reasons}); check the field names "
                         "(finetune.*_key, data.prompt_key) and finetune.max_length")
    report.used = len(examples)
    return examples


def sft_examples(rows: list[dict], cfg: RLConfig, tokenizer: Tokenizer, where: str,
                 max_length: int) -> tuple[list[Completion], RecordReport]:
    """``prompt, completion`` or ``messages`` records -> completions."""
    enc, report, out = _Encoder(cfg, tokenizer, max_length), RecordReport(where), []
    for row in rows:
        if enc.f.messages_key in row:
            got = enc.conversation(row)
        else:
            prompt, completion = enc.prompt(row), enc.completion(row, enc.f.completion_key)
            got = next((x for x in (prompt, completion) if isinstance(x, str)), (prompt, completion))
        if isinstance(got, str):
            report.dropped[got] += 1
        elif enc.too_long(*got):
            report.dropped[f"over {enc.max_length} tokens"] += 1
        else:
            out.append(Completion(*got))
    return _finish(report, out, where), report


def pair_examples(rows: list[dict], cfg: RLConfig, tokenizer: Tokenizer, where: str,
                  max_length: int) -> tuple[list[Pair], RecordReport]:
    """``prompt, chosen, rejected`` records -> pairs (with the margin field, if configured)."""
    enc, report, out = _Encoder(cfg, tokenizer, max_length), RecordReport(where), []
    for row in rows:
        parts = [enc.prompt(row), enc.completion(row, enc.f.chosen_key),
                 enc.completion(row, enc.f.rejected_key)]
        problem = next((x for x in parts if isinstance(x, str)), None)
        margin = 0.0
        if problem is None and enc.f.margin_key:
            try:
                margin = float(row[enc.f.margin_key])
            except (KeyError, TypeError, ValueError):
                problem = f"no numeric '{enc.f.margin_key}' field"
        if problem is not None:
            report.dropped[problem] += 1
        elif enc.too_long(*parts):
            report.dropped[f"over {enc.max_length} tokens"] += 1
        else:
            out.append(Pair(*parts, margin=margin))
    return _finish(report, out, where), report


def _label(value) -> bool | None:
    key = value.strip().lower() if isinstance(value, str) else value
    if isinstance(key, float) and key.is_integer():
        key = int(key)
    if key in DESIRABLE:
        return True
    return False if key in UNDESIRABLE else None


def kto_examples(rows: list[dict], cfg: RLConfig, tokenizer: Tokenizer, where: str,
                 max_length: int) -> tuple[list[Completion], RecordReport]:
    """``prompt, completion, label`` records -> labelled completions."""
    enc, report, out = _Encoder(cfg, tokenizer, max_length), RecordReport(where), []
    for row in rows:
        prompt, completion = enc.prompt(row), enc.completion(row, enc.f.completion_key)
        label = _label(row.get(enc.f.label_key)) if enc.f.label_key in row else None
        problem = next((x for x in (prompt, completion) if isinstance(x, str)), None)
        if problem is None and label is None:
            problem = (f"no '{enc.f.label_key}' field" if enc.f.label_key not in row
                       else f"a '{enc.f.label_key}' that is neither desirable nor undesirable")
        if problem is not None:
            report.dropped[problem] += 1
        elif enc.too_long(prompt, completion):
            report.dropped[f"over {enc.max_length} tokens"] += 1
        else:
            out.append(Completion(prompt, completion, label))
    return _finish(report, out, where), report


EXAMPLES = {"sft": sft_examples, "dpo": pair_examples, "rm": pair_examples, "kto": kto_examples,
            "online_dpo": pair_examples}
"""``train.job`` -> its tokenizer of records."""
