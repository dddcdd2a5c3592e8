"""Tokenizers behind one small interface: HF tokenizers (with chat templates) and the
character tokenizer of the built-in quick-start task."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """Prompt token ids, wrapped in the chat template when ``chat`` is true."""

    def encode_conversation(self, messages: list[dict], chat: bool) -> list[int]:
        """Token ids of chat ``messages`` ({role, content}) followed by the start of the
        assistant's reply: the chat template when ``chat`` is true and the tokenizer has
        one, else the contents one after another."""


class HFTokenizer:
    """An HF tokenizer; prompts go through its chat template when asked."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        if chat and self.tok.chat_template:
            return self.encode_conversation([{"role": "user", "content": text}], chat)
        return self.tok.encode(text)

    def encode_conversation(self, messages: list[dict], chat: bool) -> list[int]:
        if chat and self.tok.chat_template:
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5: a BatchEncoding
            return [int(i) for i in ids]
        return self.tok.encode("".join(str(m["content"]) for m in messages))


class CharTokenizer:
    """One token per character of a fixed alphabet, plus <pad>, <bos> and <eos>.

    Saved as ``char_tokenizer.json`` next to a model so the model directory is complete.
    """

    FILE = "char_tokenizer.json"

    def __init__(self, alphabet: str):
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._ids = {c: i + 3 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err} is not in the tokenizer's alphabet "
                             f"{self.alphabet!r}") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - 3] for i in ids if i >= 3)

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        return [self.bos_id] + self.encode(text)

    def encode_conversation(self, messages: list[dict], chat: bool) -> list[int]:
        return self.encode_prompt("".join(str(m["content"]) for m in messages), chat)

    def save(self, directory: str | Path) -> None:
        (Path(directory) / self.FILE).write_text(json.dumps({"alphabet": self.alphabet}))

    def to_hf(self):
        """The same tokenizer as a transformers ``PreTrainedTokenizerFast`` (for tools that
        need one): identical ids, a <bos> prepended as `encode_prompt` does."""
        from tokenizers import Regex, Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": self.pad_id, "<bos>": self.bos_id, "<eos>": self.eos_id, **self._ids}
        raw = RawTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        raw.decoder = decoders.Fuse()
        raw.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", self.bos_id)])
        return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>",
                                       eos_token="<eos>", padding_side="left")

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        return cls(json.loads((Path(directory) / cls.FILE).read_text())["alphabet"])


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer stored with a model directory."""
    if (Path(model_dir) / CharTokenizer.FILE).exists():
        return CharTokenizer.load(model_dir)
    return HFTokenizer(model_dir)
