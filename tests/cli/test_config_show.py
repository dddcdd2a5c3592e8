"""`mcore-rl config show`: resolved YAML out; a bad config is one line, exit 2, nothing started."""
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import sys
from mcore_rl.cli.main import main
code = main(sys.argv[1:])
import torch.distributed as dist
print("STARTED" if dist.is_initialized() or "megatron.core" in sys.modules else "NOTHING-STARTED")
sys.exit(code)
"""


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_show_prints_the_resolved_config_with_overrides():
    proc = run_cli("config", "show", "configs/smoke.yaml", "rollout.temperature=0.5")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout.replace("NOTHING-STARTED", ""))
    assert shown["rollout"]["temperature"] == 0.5
    assert shown["parallel"]["tp"] == 2  # from the YAML file


def test_tp_that_does_not_divide_heads_exits_2_with_one_line_and_starts_nothing():
    proc = run_cli("config", "show", "configs/smoke.yaml", "parallel.tp=3")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["mcore-rl config: error: parallel.tp=3 does not divide the model's 4 attention "
                     "heads; choose one of 1, 2, 4"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip() == "NOTHING-STARTED"


def test_unknown_benchmark_is_a_usage_error():
    proc = run_cli("bench", "no-such-bench")
    assert proc.returncode == 2
    assert "unknown benchmark 'no-such-bench'; available:" in proc.stderr
