"""A prompt as every source yields it (its own module: the sources of `prompts` and the
tasks they generate all make them)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptRecord:
    prompt: str
    """Prompt text as given by the dataset (before any chat template)."""
    meta: dict = field(default_factory=dict)
    """What the reward function receives (e.g. ``answer``)."""
    token_ids: tuple[int, ...] | None = None
    """The prompt's token ids, when given as tokens (used as they are: no chat template)."""
