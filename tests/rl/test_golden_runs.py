"""The golden runs (tests/rl/golden/runs.py) replay to round-off: GRPO and PPO at TP1 and
TP2, and the adaptive KL coefficient with the KL as a loss term and as a reward penalty."""
import json
import math

import pytest

from tests.rl.golden.runs import RUNS, golden_file, play


def golden(name: str) -> list[dict]:
    """The golden values of run ``name`` on this kind of CPU (tests that read them are marked
    `golden`: they skip on a kind with none, since runs part from round-off, which differs
    between kinds of CPU)."""
    path = golden_file(name)
    expected = json.loads(path.read_text())
    assert len(expected) == 4 and all(len(row) > 5 for row in expected[1:]), f"{path} is too thin"
    return expected


def _mismatches(expected: list[dict], got: list[dict]) -> list[str]:
    out = []
    if [r["step"] for r in expected] != [r["step"] for r in got]:
        return [f"steps {[r['step'] for r in got]} != {[r['step'] for r in expected]}"]
    for want, have in zip(expected, got):
        for key, value in want.items():
            if key not in have:
                out.append(f"step {want['step']}: {key} missing")
            elif not math.isclose(have[key], value, rel_tol=1e-5, abs_tol=1e-6):
                out.append(f"step {want['step']}: {key} = {have[key]!r}, golden {value!r}")
    return out


@pytest.mark.golden
@pytest.mark.parametrize("name", list(RUNS))
def test_golden_run_reproduces_its_recorded_metrics(tmp_path, name):
    expected = golden(name)
    problems = _mismatches(expected, play(name, str(tmp_path)))
    assert not problems, "\n".join(problems[:20])
