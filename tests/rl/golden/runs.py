"""Golden RL runs: short fixed-seed runs whose metrics every change must reproduce.

Each run is the quick-start task on the in-process ``hf`` engine (deterministic on CPU),
a short warm start and three RL steps, with every role fused into the trainer's ranks;
``tests/roles/test_rl_graph.py`` replays them through the other placements. ``python -m tests.rl.golden.runs [NAME ...]``
records the metrics into ``tests/rl/golden/<cpu kind>/<name>.json`` (on the CPU code path
that ``tests/cpu_kernels.py`` pins for the suite); ``tests/rl/test_golden_runs.py``
replays each run and compares every metric but timings to round-off, against the values
of the CPU kind it runs on.

First recorded before the architecture rework (weight sync as transports, typed run
state), which replayed them; ``grpo_kl_in_reward_adaptive_tp1`` was recorded again after a
fix (the adaptive KL controller had read ``actor/kl_loss``, which does not exist when the KL
is a reward penalty), and all six again when core attention moved to PyTorch's fused
attention (sampling parts from round-off). ``x86-avx2`` holds the values of an AVX2-only
machine, which CI replayed; ``x86-avx512-amx`` those of a machine with AVX-512 and AMX,
recorded by the same code, where the AVX2 values do not replay (see tests/cpu_kernels.py).
They run with ``train.share_prompts=false``, the trainer's layout they were recorded with:
the shared-prompt layout computes the same up to round-off, from which sampling parts
within a step (its parity with the unshared layout is tested in
``tests/train/test_shared_prompts.py``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BASE = ["rollout.engine=hf", "train.warm_start_steps=40", "train.steps=3", "train.val_every=3",
        "data.num_val=16", "checkpoint.save_every=0", "logging.progress_bar=false",
        "logging.backends=[jsonl]", "logging.samples_every=0", "reshard.verify=true",
        "reshard.verify_every=1", "train.share_prompts=false"]
PPO = ["algorithm.advantage_estimator=gae", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2",
       "optimizer.critic_lr=1e-3"]
KL = ["algorithm.kl_coef=0.05", "algorithm.adaptive_kl_target=0.01"]
# name -> (world size, overrides of configs/quickstart.yaml)
RUNS: dict[str, tuple[int, list[str]]] = {
    "grpo_tp1": (1, []),
    "grpo_tp2": (2, ["parallel.tp=2"]),
    "ppo_tp1": (1, PPO),
    "ppo_tp2": (2, ["parallel.tp=2"] + PPO),
    "grpo_kl_loss_adaptive_tp1": (1, KL),
    "grpo_kl_in_reward_adaptive_tp1": (1, KL + ["algorithm.kl_in_reward=true"]),
}
TIMING_PREFIXES = ("time/", "sync/seconds", "sync/transfer_s", "sync/apply_s", "perf/tokens_per_s")


def golden_dir() -> Path:
    """Where the golden values are kept for this machine's kind of CPU."""
    from tests.cpu_kernels import cpu_kind

    return HERE / cpu_kind()


def golden_file(name: str) -> Path:
    """Where the golden values of run ``name`` are kept for this machine's kind of CPU."""
    return golden_dir() / f"{name}.json"


def run_golden(rank, world_size, overrides):
    """One golden run on a rank of a shared world, every role fused into the trainer's ranks
    (``rollout.placement: fused``, `mcore_rl.roles.graph.run_in_this_world`); rank 0
    returns the metrics history."""
    from mcore_rl.config import load_config
    from mcore_rl.parallel import destroy_parallel
    from mcore_rl.roles.graph import run_in_this_world
    from mcore_rl.roles.rules import check_config

    cfg = check_config(load_config(REPO / "configs" / "quickstart.yaml", overrides), world_size)
    try:
        run_in_this_world(cfg)
    finally:
        destroy_parallel()
    path = Path(cfg.logging.dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if rank == 0 else None


def comparable(history: list[dict]) -> list[dict]:
    """The history without timings (which differ from run to run)."""
    return [{k: v for k, v in h.items() if not k.startswith(TIMING_PREFIXES)} for h in history]


def play(name: str, log_dir: str) -> list[dict]:
    size, overrides = RUNS[name]
    return comparable(play_overrides(size, BASE + overrides, log_dir))


def play_overrides(size: int, overrides: list[str], log_dir: str) -> list[dict]:
    """The metrics history of the quick start with ``overrides`` on a shared world of ``size``."""
    from tests.world import shared_world

    return shared_world(size).run(run_golden, overrides + [f"logging.dir={log_dir}"])[0]


def main(names: list[str]) -> None:
    import tempfile

    from tests.world import close_shared_worlds

    try:
        for name in names or list(RUNS):
            with tempfile.TemporaryDirectory() as tmp:
                history = play(name, tmp)
            path = golden_file(name)
            path.parent.mkdir(exist_ok=True)
            tmp_path = path.with_suffix(".json.tmp")
            tmp_path.write_text(json.dumps(history, indent=1) + "\n")
            tmp_path.replace(path)
            print(f"recorded {name} into {path.relative_to(REPO)}: {len(history)} rows", flush=True)
    finally:
        close_shared_worlds()


if __name__ == "__main__":
    from tests.cpu_kernels import pin_cpu_kernels

    pin_cpu_kernels()  # the code path the test suite replays on
    main(sys.argv[1:])
