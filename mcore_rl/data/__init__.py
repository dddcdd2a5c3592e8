"""Prompt data, batching and the batch type shared by every phase."""
from mcore_rl.data.prompts import PROMPT_SOURCES, PromptRecord, PromptStream, load_prompt_records

__all__ = ["PROMPT_SOURCES", "PromptRecord", "PromptStream", "load_prompt_records"]
