"""`mcore-rl bench convert`: time and peak memory of HF <-> Megatron checkpoint conversion.

    mcore-rl bench convert --json OUT.json [--hf-dir DIR]   # default model: SmolLM2-135M

Each conversion runs in a fresh Python process, which reports its wall time and its peak
resident memory (``ru_maxrss``), next to its resident memory after imports, so the
conversion's own share is visible. Baseline, measured in the same run the same way: the
usual in-memory route, transformers ``from_pretrained`` + ``save_pretrained`` of the whole
model. The JSON holds ``{"ours", "baseline", "unit", "speedup"|"ratio"}`` per comparison and
the model's size, so "peak memory is about the largest tensor, not the model" can be read off.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from mcore_rl.benchmarks._common import memory_comparison, rounded, time_comparison, write_json

# Runs in the child process; prints one JSON line.
_CHILD = r"""
import json, os, resource, sys, time
import psutil
task, src, dst = sys.argv[1:4]
if task == "baseline":
    import torch, transformers
else:
    from mcore_rl.convert import convert_hf_to_mcore, convert_mcore_to_hf
rss_after_imports = psutil.Process().memory_info().rss
start = time.perf_counter()
if task == "hf-to-mcore":
    convert_hf_to_mcore(src, dst, progress=False)
elif task == "mcore-to-hf":
    convert_mcore_to_hf(src, dst, progress=False)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    model.save_pretrained(dst)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak_rss_bytes": peak,
                  "rss_after_imports_bytes": rss_after_imports}))
"""

MIB = 1024 * 1024


def _run_child(task: str, src: Path, dst: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", _CHILD, task, str(src), str(dst)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{task} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _model_size(hf_dir: Path) -> dict:
    from mcore_rl.models.safetensors_io import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(hf_dir)
    tensors = ckpt.tensors.values()
    largest = max(tensors, key=lambda t: t.end - t.start)
    return {"safetensors_bytes": sum(t.end - t.start for t in tensors),
            "parameters": sum(math.prod(t.shape) for t in tensors),
            "largest_tensor_bytes": largest.end - largest.start}


def _above_imports(run: dict) -> int:
    return run["peak_rss_bytes"] - run["rss_after_imports_bytes"]


def _compare(ours: dict, baseline: dict) -> dict:
    """Time and peak memory, ours against the baseline (4 significant digits)."""
    return rounded({
        "seconds": time_comparison(ours["seconds"], baseline["seconds"]),
        "peak_rss": memory_comparison(ours["peak_rss_bytes"] / MIB, baseline["peak_rss_bytes"] / MIB),
        "peak_rss_above_imports": memory_comparison(
            _above_imports(ours) / MIB, max(1, _above_imports(baseline)) / MIB),
    })


def run(hf_dir: Path) -> dict:
    """Convert ``hf_dir`` both ways (and the baseline) in fresh processes; the report."""
    with tempfile.TemporaryDirectory(prefix="mcore-rl-bench-convert-") as tmp:
        tmp = Path(tmp)
        to_mcore = _run_child("hf-to-mcore", hf_dir, tmp / "mcore")
        to_hf = _run_child("mcore-to-hf", tmp / "mcore", tmp / "hf")
        baseline = _run_child("baseline", hf_dir, tmp / "baseline")
    size = _model_size(hf_dir)
    return {
        "benchmark": "convert",
        "model": {"dir": str(hf_dir), **size,
                  "safetensors_mib": round(size["safetensors_bytes"] / MIB, 1),
                  "largest_tensor_mib": round(size["largest_tensor_bytes"] / MIB, 1)},
        "baseline": "transformers from_pretrained + save_pretrained of the whole model",
        "hf_to_mcore": _compare(to_mcore, baseline),
        "mcore_to_hf": _compare(to_hf, baseline),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mcore-rl bench convert",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--hf-dir", help="HF model directory (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    if args.hf_dir:
        hf_dir = Path(args.hf_dir)
    else:
        from mcore_rl.models.smollm2 import prepare_smollm2_hf_dir

        hf_dir = prepare_smollm2_hf_dir()
    report = run(hf_dir)
    write_json(args.json, report)
    print(json.dumps(report, indent=2))
    return 0
