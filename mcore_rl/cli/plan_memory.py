"""`mcore-rl plan memory CONFIG [KEY=VALUE ...] [--gpu-memory-gib 80] [--json OUT]`: the
bytes one trainer rank holds under a config, itemised, whether they fit a device, and which
knob to turn if not (`mcore_rl.plan.memory`). Computed, not measured."""
from __future__ import annotations

from pathlib import Path

from mcore_rl.errors import UsageError


def model_arch(cfg, model: str | None):
    """The model's shape: ``--model`` or ``model.path`` naming a preset
    (`mcore_rl.plan.model_shapes`), an HF directory or an mcore-rl checkpoint; without a path,
    the config's inline shape."""
    from mcore_rl.plan.model_shapes import PRESETS, preset

    path = model if model is not None else cfg.model.path
    if not path:
        from mcore_rl.train.smoke import arch_from_inline

        return arch_from_inline(cfg), "the config's inline model"
    found = preset(path)
    if found is not None:
        return found, path
    from mcore_rl.models.builtin import resolve_model_path
    from mcore_rl.models.provider import read_model_spec

    directory = resolve_model_path(path)
    if not Path(directory).is_dir():
        raise UsageError(f"model {path!r}: neither a directory nor a known shape; give an HF "
                         f"directory or one of {', '.join(PRESETS)}")
    return read_model_spec(directory).arch, path


def run(args) -> int:
    from mcore_rl.atomic_write import write_json_atomic
    from mcore_rl.algos.advantages import needs_critic
    from mcore_rl.cli.out_path import check_out
    from mcore_rl.config import load_config
    from mcore_rl.plan.memory import GIB, Shape, format_plan, plan_memory

    if not Path(args.config).is_file():
        raise UsageError(f"plan memory: {args.config}: no such config file")
    if args.gpu_memory_gib <= 0:
        raise UsageError(f"--gpu-memory-gib {args.gpu_memory_gib}: give the device memory in "
                         "GiB, e.g. 80")
    check_out(args.json, "--json")
    cfg = load_config(args.config, args.overrides)
    arch, name = model_arch(cfg, args.model)
    shape = Shape.from_config(cfg, arch, critic=needs_critic(cfg.algorithm.advantage_estimator))
    plan = plan_memory(shape, args.gpu_memory_gib)
    print(f"{name}, {shape.dtype}, per trainer rank (computed, not measured):")
    print(format_plan(plan))
    if args.json:
        write_json_atomic(args.json, {"model": name, "gpu_memory_gib": args.gpu_memory_gib,
                                      "gib": {i.name: i.bytes / GIB for i in plan.items},
                                      **plan.to_dict()})
        print(f"wrote {args.json}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "memory", help="per-rank memory of a config, itemised (computed, not measured)",
        description=__doc__)
    p.add_argument("config", help="config YAML")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, as for mcore-rl train")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="memory of one device in GiB (default 80)")
    p.add_argument("--model", default=None,
                   help="the model's shape instead of model.path: an HF directory or a known "
                        "name (e.g. Qwen/Qwen2.5-7B)")
    p.add_argument("--json", default=None, help="write the plan as JSON to this file")
    p.set_defaults(func=run)
