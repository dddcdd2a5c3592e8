"""Shared pieces of the benchmarks: timing, comparison records, atomic JSON output.

Every comparison reads ``{"ours", "baseline", "unit", "speedup"}`` (``"ratio"`` for
memory), both sides measured in the same run on the same machine.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from mcore_rl.atomic_write import write_json_atomic


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput_comparison(ours: float, baseline: float, unit: str) -> dict:
    """Higher is better (e.g. tokens/s): speedup = ours / baseline."""
    return {"ours": ours, "baseline": baseline, "unit": unit,
            "speedup": ours / baseline if baseline else None}


def time_comparison(ours: float, baseline: float, unit: str = "s") -> dict:
    """Lower is better (durations): speedup = baseline / ours."""
    return {"ours": ours, "baseline": baseline, "unit": unit,
            "speedup": baseline / ours if ours else None}


def memory_comparison(ours: float, baseline: float, unit: str = "MiB") -> dict:
    """Lower is better: ratio = ours / baseline."""
    return {"ours": ours, "baseline": baseline, "unit": unit,
            "ratio": ours / baseline if baseline else None}


def rounded(data, digits: int = 4):
    """``data`` with every float rounded to ``digits`` significant digits (for reports)."""
    if isinstance(data, float):
        return float(f"{data:.{digits}g}")
    if isinstance(data, dict):
        return {k: rounded(v, digits) for k, v in data.items()}
    if isinstance(data, list):
        return [rounded(v, digits) for v in data]
    return data


def machine_info() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}


def write_json(path: str | Path, data: dict) -> Path:
    """Write ``data`` atomically (temporary file, then rename), creating its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, data, indent=2)


def median_of(steps: list[dict], key: str) -> float:
    """The median of ``key`` over per-step records."""
    return statistics.median(s[key] for s in steps)


def run_spec_module(module: str, spec: dict, work: Path, name: str, what: str):
    """``python -m module SPEC OUT`` in a fresh process (cwd: the repository): ``spec``
    written to ``work/<name>_spec.json``, the JSON it writes to ``work/<name>_out.json``
    returned; a failure raises with the end of its stderr, naming ``what`` ran."""
    spec_path, out_path = work / f"{name}_spec.json", work / f"{name}_out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", module, str(spec_path), str(out_path)],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out_path.read_text())
