"""`mcore-rl`: the console command. Subcommands live in one small module each.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (``args -> exit code``). Bad input is reported as one line on stderr with exit
status 2 (`UsageError` and ``ConfigError`` are caught here); no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from mcore_rl import __version__
from mcore_rl.errors import UsageError
from mcore_rl.process_exit import exit_now

SUBCOMMANDS = ("train", "convert", "bench", "launch", "placement", "config", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-rl",
        description="RL post-training (PPO, GRPO) of LLMs on Megatron-Core.")
    parser.add_argument("--version", action="version", version=f"mcore-rl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"mcore_rl.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `section.field=value` overrides may come before or after options such as --nproc.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"mcore-rl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The console command: `main`, then the end of the process without the interpreter's
    teardown of the modules a command imported (`exit_now`; seconds after torch)."""
    exit_now(main())


if __name__ == "__main__":
    run()
