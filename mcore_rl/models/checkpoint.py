"""The mcore-rl model checkpoint: a Megatron distributed checkpoint plus what it takes to go back.

Layout of a checkpoint directory::

    mcore_rl.json   format version, family, head, ModelArch (incl. the vocabulary pad
                    multiple), dtype, the layout it was written from
    model/          Megatron-Core ``dist_checkpointing`` (torch_dist) of the model chunks:
                    loadable at any TP/PP/VPP whose sizes divide the model
    hf/             HF config.json, generation_config.json, tokenizer files and chat template

Writing one from a running model is `save_mcore_checkpoint` (collective); loading one into
model chunks is `load_mcore_weights`. ``mcore_rl.convert`` writes and reads the same layout
from and to HF checkpoints without building a model. Every Megatron distributed checkpoint
of this package (training state too) is written by `save_sharded`.
"""
from __future__ import annotations

import fnmatch
import json
import queue
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.errors import UsageError
from mcore_rl.models.arch import ModelArch
from mcore_rl.models.families import MODEL_FAMILIES
from mcore_rl.models.hf_config import ModelSpec, read_config_json

FORMAT_NAME = "mcore-rl-checkpoint"
FORMAT_VERSION = 1
META_FILE = "mcore_rl.json"
MODEL_DIR = "model"
HF_DIR = "hf"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Files that travel with a model besides its weights.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                 "vocab.txt", "merges.txt", "chat_template.json", "chat_template.jinja",
                 "preprocessor_config.json")
HF_SIDE_PATTERNS = ("*.tiktoken", "*.jinja")


@dataclass(frozen=True)
class CheckpointMeta:
    """The contents of ``mcore_rl.json``."""

    spec: ModelSpec
    dtype: str
    """``fp32``, ``bf16`` or ``fp16``: the dtype the tensors are stored in."""
    written_layout: dict

    def to_json(self) -> dict:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                "family": self.spec.family.model_type, "head": self.spec.head,
                "arch": self.spec.arch.to_dict(), "dtype": self.dtype,
                "written_layout": self.written_layout}


def is_mcore_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_checkpoint_meta(path: str | Path) -> CheckpointMeta:
    """`CheckpointMeta` of a checkpoint directory; `UsageError` when it is not one."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise UsageError(f"{path} is not an mcore-rl checkpoint (no {META_FILE})")
    raw = json.loads((path / META_FILE).read_text())
    if raw.get("format") != FORMAT_NAME or raw.get("version") != FORMAT_VERSION:
        raise UsageError(f"{path / META_FILE}: unknown format {raw.get('format')!r} version "
                         f"{raw.get('version')!r} (expected {FORMAT_NAME} {FORMAT_VERSION})")
    if not (path / MODEL_DIR / ".metadata").is_file():
        raise UsageError(f"{path / MODEL_DIR} holds no Megatron distributed checkpoint")
    spec = ModelSpec(arch=ModelArch.from_dict(raw["arch"]), family=MODEL_FAMILIES[raw["family"]],
                     head=raw["head"], hf_config=read_config_json(path / HF_DIR))
    return CheckpointMeta(spec=spec, dtype=raw["dtype"], written_layout=raw["written_layout"])


def write_checkpoint_meta(path: str | Path, meta: CheckpointMeta) -> None:
    (Path(path) / META_FILE).write_text(json.dumps(meta.to_json(), indent=2) + "\n")


def copy_hf_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config, generation config, tokenizer and chat-template files; names copied."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in sorted(src.iterdir()):
        if file.is_file() and (file.name in HF_SIDE_FILES
                               or any(fnmatch.fnmatch(file.name, p) for p in HF_SIDE_PATTERNS)):
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied


def _sharded_state_dict(chunks: list, skip_keys: tuple[str, ...]) -> dict:
    out = {}
    for i, chunk in enumerate(chunks):
        sharded = chunk.sharded_state_dict()
        out[f"chunk{i}"] = {name: v for name, v in sharded.items()
                            if getattr(v, "key", None) not in skip_keys}
    return out


@torch.no_grad()
def load_mcore_weights(chunks: list, path: str | Path, skip_keys: tuple[str, ...] = ()) -> None:
    """Load a checkpoint's weights into this rank's chunks (collective over all ranks).

    ``skip_keys``: Megatron keys to leave as they are (a critic's fresh head). Any other
    tensor the checkpoint lacks raises; Megatron's per-layer ``_extra_state`` objects may be
    absent (a checkpoint written with the local spec loaded into the TE spec, or vice versa).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    sharded = _sharded_state_dict(chunks, skip_keys)
    state, missing, _ = dist_checkpointing.load(sharded, str(Path(path) / MODEL_DIR),
                                                strict=StrictHandling.RETURN_ALL)
    missing = sorted(k for k in missing if "_extra_state" not in k)
    if missing:
        raise UsageError(f"checkpoint {path} lacks {', '.join(missing[:3])}")
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(state[f"chunk{i}"], strict=False)
        not_loaded = [k for k in result.missing_keys
                      if "_extra_state" not in k and not _skipped(k, skip_keys)]
        if not_loaded or result.unexpected_keys:
            raise RuntimeError(f"loading {path}: missing {not_loaded}, "
                               f"unexpected {result.unexpected_keys}")


def _skipped(name: str, skip_keys: tuple[str, ...]) -> bool:
    return any(name == key or name.endswith("." + key) for key in skip_keys)


def save_sharded(state: dict, path: str | Path) -> None:
    """Megatron's ``dist_checkpointing.save`` of ``state`` to ``path``, synchronously.

    Megatron's torch_dist writer hands its write results back on a module-wide queue that it
    makes on a process's first save, served by a spawned ``multiprocessing`` manager: a fresh
    interpreter that costs seconds and outlives a rank that is killed. A synchronous save
    puts and takes those results in the saving process, so a plain queue serves instead."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(state, str(path))


def save_mcore_checkpoint(chunks: list, path: str | Path, spec: ModelSpec, hf_files_dir: str | Path,
                          layout: dict) -> None:
    """Write this model as an mcore-rl checkpoint (collective: every rank calls it).

    ``hf_files_dir``: where config/tokenizer files come from (an HF dir or a checkpoint's
    ``hf/``). ``path`` must not exist or be empty.
    """
    import torch.distributed as dist

    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if path.exists() and any(path.iterdir()):
            raise UsageError(f"{path} exists and is not empty")
        (path / MODEL_DIR).mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    save_sharded(_sharded_state_dict(chunks, ()), path / MODEL_DIR)
    if rank == 0:
        dtype = DTYPE_NAMES[next(chunks[0].parameters()).dtype]
        copy_hf_side_files(hf_files_dir, path / HF_DIR)
        write_checkpoint_meta(path, CheckpointMeta(spec=spec, dtype=dtype, written_layout=layout))
    if dist.is_initialized():
        dist.barrier()
