"""Prompt data, batching and the batch type shared by every phase."""
