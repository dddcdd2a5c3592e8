"""`mcore-rl convert`: HuggingFace <-> Megatron-Core checkpoints."""
from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron-Core")
    p.set_defaults(func=lambda args: p.error("not implemented yet"))
