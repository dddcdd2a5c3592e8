"""`mcore-rl plan --costs FILE --devices 8,64`: what each schedule (sync, one_step_off,
async at each K) would make of a device budget, split between engines and trainer or shared
by both in turns (``--placement``), simulated on a virtual clock from
per-phase costs (`mcore_rl.plan`). Prints one table per device count and, with ``--out``,
writes the rows as JSON (to a temporary file, then renamed: never half a file).

The figures are the model's output, as good as the costs it is given.
"""
from __future__ import annotations

import json
from pathlib import Path

from mcore_rl.atomic_write import write_json_atomic
from mcore_rl.cli.out_path import check_out
from mcore_rl.errors import UsageError

EXAMPLE = "configs/plan/costs_example.json"


def load_costs(path: str):
    """The `CostModel` of a costs JSON file; one-line `UsageError` for any bad input."""
    from mcore_rl.plan import CostModel

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--costs {path}: no such file; give a costs JSON (e.g. {EXAMPLE})")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"--costs {path} is not valid JSON ({err}); fix the file") from None
    return CostModel.from_dict(data)


def parse_list(option: str, text: str, kind: type, example: str) -> list:
    """``"8,64"`` -> [8, 64] (``kind`` int) or ``"0.5,0.75"`` -> [0.5, 0.75] (float)."""
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise UsageError(f"{option} {text!r}: give comma-separated {noun}, "
                         f"e.g. {example}") from None


def run(args) -> int:
    from mcore_rl.plan.scaling import format_table, plan_for_devices, split_devices

    if args.costs is None or args.devices is None:
        raise UsageError("plan: give --costs FILE --devices N,... (schedules on a device "
                         "budget), or: mcore-rl plan memory CONFIG (memory per rank)")
    costs = load_costs(args.costs)
    devices = parse_list("--devices", args.devices, int, "8,64")
    shares = parse_list("--engine-share", args.engine_share, float, "0.5,0.75")
    ks = parse_list("--k", args.k, int, "0,1,2")
    from mcore_rl.plan.simulator import PLACEMENTS

    placements = [p.strip() for p in args.placement.split(",") if p.strip()]
    if not placements or any(p not in PLACEMENTS for p in placements):
        raise UsageError(f"--placement {args.placement!r}: give separate, colocated or both, "
                         "comma-separated")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give an integer >= 1")
    check_out(args.out)
    for count in devices:  # every split is checked before the first simulation
        for placement in placements:
            for share in shares:
                split_devices(costs, count, share, args.efficiency, placement)
    tables, rows = [], []
    for count in devices:
        found = plan_for_devices(costs, count, shares, ks=ks, on_stale=args.on_stale,
                                 partial=args.partial, steps=args.steps, seed=args.seed,
                                 efficiency=args.efficiency, placements=placements)
        tables.append(f"{count} devices:\n{format_table(found)}")
        rows += [{"devices": count, **row} for row in found]
    print("\n\n".join(tables))
    if args.out:
        write_json_atomic(args.out, {"costs": costs.to_dict(), "devices": devices,
                              "engine_share": shares, "placement": placements, "k": ks,
                              "steps": args.steps,
                              "seed": args.seed, "efficiency": args.efficiency,
                              "on_stale": args.on_stale, "partial": args.partial,
                              "rows": rows})
        print(f"wrote {args.out}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="simulate each schedule on a device budget (model output, not measurements)",
        description="Simulate sync, one_step_off and async (each K) for each device count, "
                    "from per-phase costs; print a table, optionally write JSON.")
    p.add_argument("--costs", help=f"costs JSON (CostModel fields), e.g. {EXAMPLE}")
    p.add_argument("--devices", help="device counts, comma-separated (e.g. 8,64)")
    p.add_argument("--engine-share", default="0.5",
                   help="fractions of the devices for engine replicas, comma-separated "
                        "(default 0.5)")
    p.add_argument("--placement", default="separate",
                   help="separate (engines and trainer on disjoint devices, split by "
                        "--engine-share), colocated (both on every device, in turns), or both "
                        "comma-separated (default separate)")
    p.add_argument("--k", default="1,2",
                   help="max staleness K of async, comma-separated (default 1,2)")
    p.add_argument("--steps", type=int, default=40, help="trainer steps simulated (default 40)")
    p.add_argument("--on-stale", choices=("drop", "regenerate"), default="drop")
    p.add_argument("--partial", choices=("continue", "abort"), default="continue")
    p.add_argument("--efficiency", type=float, default=0.9,
                   help="trainer scaling per doubling of its devices (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the response-length draws")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    p.set_defaults(func=run)
    from mcore_rl.cli import plan_memory

    plan_memory.register(p.add_subparsers(dest="plan_what", metavar="{memory}"))
