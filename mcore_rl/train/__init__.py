"""The Megatron train engine: the only code that knows Megatron's schedules, DDP and optimizer."""
