"""The environment interface of multi-turn rollouts.

An environment plays one episode per sampled response::

    env = ENVIRONMENTS.get(name)(tokenizer)
    env.reset(prompt_meta)                  # the dataset record's fields
    step = env.step(turn_token_ids)         # the engine's tokens of one turn, as generated
    step.observation                        # token ids appended after that turn (no loss)
    step.reward, step.done

Everything is token ids: an episode's earlier turns are never decoded and re-encoded, so the
trainer sees exactly the ids the engine produced and the ids the environment returned.
A turn ends when the engine emits one of the environment's ``stop_token_ids`` (or
end-of-sequence); an environment decodes a turn itself when it needs its text.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from mcore_rl.registry import Registry


@dataclass
class EnvStep:
    """What the environment answers to one engine turn."""

    observation: list[int] = field(default_factory=list)
    """Token ids appended after the turn (masked out of the loss); ignored when done."""
    reward: float = 0.0
    """Reward of this turn; an episode's rewards are summed into its score."""
    done: bool = False
    """The episode ends here."""


class Environment(ABC):
    """One episode at a time; a fresh instance per sampled response."""

    stop_strings: tuple[str, ...] = ()
    """Texts that end an engine turn besides end-of-sequence (each one token of the
    tokenizer); `stop_token_ids` turns them into ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def stop_token_ids(self) -> list[int]:
        """The token ids that end a turn (besides end-of-sequence)."""
        ids = []
        for text in self.stop_strings:
            encoded = self.tokenizer.encode(text)
            if len(encoded) != 1:
                raise ValueError(f"environment {type(self).__name__}: its turn end {text!r} is "
                                 f"{len(encoded)} tokens for this tokenizer; it must be one")
            ids += encoded
        return ids

    @abstractmethod
    def reset(self, prompt_meta: dict) -> None:
        """Start an episode for the prompt whose record fields are ``prompt_meta``."""

    @abstractmethod
    def step(self, turn: list[int]) -> EnvStep:
        """The engine's token ids of one turn (its stop token included) -> the answer."""


ENVIRONMENTS: Registry = Registry("environment")
"""``environment.name`` -> an `Environment` class (``cls(tokenizer)``)."""
