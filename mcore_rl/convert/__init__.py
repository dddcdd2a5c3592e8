"""Streaming HF <-> Megatron-Core checkpoint conversion (``mcore-rl convert``).

`convert_hf_to_mcore` and `convert_mcore_to_hf` hold one tensor (one layer's piece) at a
time, check their input before writing, and produce their output all at once or not at all.
The tensor mapping comes from `mcore_rl.models.mapping`; the checkpoint layout from
`mcore_rl.models.checkpoint`.
"""
from mcore_rl.convert.hf_to_mcore import convert_hf_to_mcore
from mcore_rl.convert.mcore_to_hf import convert_mcore_to_hf

__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf"]
