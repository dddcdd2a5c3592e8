"""`mcore-rl convert`: HuggingFace <-> Megatron-Core checkpoints.

    mcore-rl convert hf-to-mcore --hf-dir HF --out CKPT [--tp N --pp M --dtype bf16|fp32]
    mcore-rl convert mcore-to-hf --mcore-dir CKPT --out HF2 [--max-shard-size 5GB]
"""
from __future__ import annotations

import re

from mcore_rl.errors import UsageError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise UsageError(f"cannot read size {text!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _hf_to_mcore(args) -> int:
    from mcore_rl.convert import convert_hf_to_mcore

    out = convert_hf_to_mcore(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                              force=args.force, progress=not args.quiet)
    print(f"wrote {out}")
    return 0


def _mcore_to_hf(args) -> int:
    from mcore_rl.convert import convert_mcore_to_hf

    out = convert_mcore_to_hf(args.mcore_dir, args.out, force=args.force,
                              max_shard_bytes=parse_size(args.max_shard_size),
                              progress=not args.quiet)
    print(f"wrote {out}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert checkpoints between HF and Megatron-Core",
        description="Convert checkpoints between HuggingFace and Megatron-Core (streaming; "
                    "the output appears only when complete).")
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF model directory -> mcore-rl checkpoint")
    a.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size it is written from")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size it is written from")
    a.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="stored dtype (default: that of the HF weights)")
    a.set_defaults(func=_hf_to_mcore)

    b = sub.add_parser("mcore-to-hf", help="mcore-rl checkpoint -> HF model directory")
    b.add_argument("--mcore-dir", required=True, help="mcore-rl checkpoint directory")
    b.add_argument("--out", required=True, help="output HF model directory")
    b.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file (default 5GB); more files get an index")
    b.set_defaults(func=_mcore_to_hf)

    for parser in (a, b):
        parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
        parser.add_argument("--quiet", action="store_true", help="no progress bar")

