"""A randomly initialised HF Llama (or, with experts, Qwen3-MoE) directory from an inline
architecture (the fields of the config's ``model`` section).

Used when ``model.path`` is empty (the built-in quick start): the run then starts from an HF
directory like any other, so the rollout engine, conversion and export see a normal model.
Writing one takes transformers (seconds of imports for a model of kilobytes), so a run
copies it from the machine's cache (`cached_random_model`), where it is written once per
architecture, token ids, seed, code of `write_random_model` and versions of the libraries
that draw it.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path
from typing import Protocol

import torch

from mcore_rl.models.cache import COMPLETE, default_cache_dir, made_once


class InlineArchitecture(Protocol):
    """The shape of a Llama given inline (e.g. the config's `ModelConfig`)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int


def write_random_model(model: InlineArchitecture, out_dir: str | Path, vocab_size: int,
                       bos_id: int, eos_id: int, pad_id: int, seed: int) -> Path:
    """Save a random ``LlamaForCausalLM``, or a ``Qwen3MoeForCausalLM`` when
    ``model.num_experts`` > 0 (fp32 safetensors + generation config)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    common = dict(
        vocab_size=vocab_size, hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_kv_heads,
        head_dim=model.hidden_size // model.num_attention_heads,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=model.tie_word_embeddings, rms_norm_eps=1e-5,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, torch_dtype="float32")
    torch.manual_seed(seed)
    if getattr(model, "num_experts", 0):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(**common, num_experts=model.num_experts,
                                num_experts_per_tok=model.experts_per_token,
                                moe_intermediate_size=model.moe_intermediate_size,
                                intermediate_size=model.intermediate_size, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[])
        Qwen3MoeForCausalLM(config).save_pretrained(out, safe_serialization=True)
    else:
        config = LlamaConfig(**common, intermediate_size=model.intermediate_size)
        LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(out)
    return out


def random_model_identity(model: InlineArchitecture, vocab_size: int, bos_id: int, eos_id: int,
                          pad_id: int, seed: int) -> dict:
    """Everything the files of `write_random_model` depend on: its arguments, its own code
    (a change to it draws the models again), and the versions of torch and transformers and
    torch's CPU kernels, which draw the weights."""
    import importlib.metadata
    import platform

    code = hashlib.sha256(inspect.getsource(write_random_model).encode()).hexdigest()[:16]
    return {"code": code,
            "architecture": {name: getattr(model, name, 0) for name in
                             InlineArchitecture.__annotations__},
            "vocab_size": vocab_size, "bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id,
            "seed": seed, "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "cpu": [platform.machine(), torch.backends.cpu.get_cpu_capability()]}


def cached_random_model(model: InlineArchitecture, vocab_size: int, bos_id: int, eos_id: int,
                        pad_id: int, seed: int) -> Path:
    """The directory `write_random_model` writes for these arguments, in the cache
    (`default_cache_dir`), written there on first use."""
    identity = random_model_identity(model, vocab_size, bos_id, eos_id, pad_id, seed)
    text = json.dumps(identity, sort_keys=True)
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    out = default_cache_dir() / "random-models" / key
    return made_once(out, lambda tmp: write_random_model(model, tmp, vocab_size, bos_id, eos_id,
                                                         pad_id, seed), note=text)


def copy_random_model(model: InlineArchitecture, out_dir: str | Path, vocab_size: int,
                      bos_id: int, eos_id: int, pad_id: int, seed: int) -> Path:
    """What `write_random_model` writes, copied from the cache (`cached_random_model`); a
    cache that cannot be written (a read-only home, a full disk) is passed by, and the model
    written directly."""
    try:
        source = cached_random_model(model, vocab_size, bos_id, eos_id, pad_id, seed)
    except OSError:
        return write_random_model(model, out_dir, vocab_size, bos_id, eos_id, pad_id, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():  # contents only: modes as this process makes files
        if path.name != COMPLETE:
            shutil.copyfile(path, out / path.name)
    return out
