"""`mcore-rl bench NAME [args]`: run a benchmark from ``benchmarks/`` (``mcore_rl.benchmarks``).

Every benchmark module has ``main(argv) -> int`` and writes JSON comparisons
``{"ours", "baseline", "unit", "speedup"|"ratio"}`` measured in the same run.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil

from mcore_rl.errors import UsageError


def available() -> list[str]:
    import mcore_rl.benchmarks as pkg

    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(pkg.__path__)
                  if not m.name.startswith("_"))


def run(args) -> int:
    names = available()
    if args.name not in names:
        raise UsageError(f"unknown benchmark '{args.name}'; available: {', '.join(names)}")
    module = importlib.import_module(f"mcore_rl.benchmarks.{args.name.replace('-', '_')}")
    return module.main(args.rest)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a throughput benchmark (writes JSON)",
                              description="Run a benchmark; pass --help after its name for its options.")
    p.add_argument("name", help="benchmark name (e.g. kernels, convert, train-engine, reshard, train)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=run)
