"""`mcore-rl config show CONFIG [overrides]`: print the resolved, validated configuration."""
from __future__ import annotations

from mcore_rl.config import dump_yaml, load_config


def show(args) -> int:
    from mcore_rl.rl.job_check import check_registered_names
    from mcore_rl.roles.rules import check_config

    cfg = check_config(load_config(args.config, args.overrides), world_size=args.world_size)
    check_registered_names(cfg)
    print(dump_yaml(cfg), end="")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("config", help="inspect configurations")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("show", help="print the resolved config (defaults + YAML + overrides)")
    s.add_argument("config", help="YAML file, e.g. configs/quickstart.yaml")
    s.add_argument("overrides", nargs="*", help="section.field=value overrides")
    s.add_argument("--world-size", type=int, default=None,
                   help="also check the layout against this many ranks")
    s.set_defaults(func=show)
