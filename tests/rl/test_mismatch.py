"""``rollout.mismatch_warn`` and ``rollout.mismatch_stop`` act on the step's
``rollout/token_mult_prob_error`` (`mcore_rl.rl.phases.check_mismatch`)."""
from types import SimpleNamespace

import pytest

from mcore_rl.config import load_config
from mcore_rl.config.ranges import check_ranges
from mcore_rl.errors import ConfigError, MismatchError
from mcore_rl.rl.phases import check_mismatch

METRICS = {"rollout/token_mult_prob_error": 1.25, "rollout/logprob_abs_diff_max": 0.7}


def state(**rollout):
    cfg = load_config(None, [f"rollout.{k}={v}" for k, v in rollout.items()])
    return SimpleNamespace(cfg=cfg, step=7, is_controller=True)


def test_above_the_stop_threshold_the_run_ends_in_one_line_naming_the_step():
    with pytest.raises(MismatchError) as err:
        check_mismatch(state(mismatch_stop=1.2), METRICS)
    message = str(err.value)
    assert message.startswith("step 7: rollout/token_mult_prob_error 1.2500")
    assert "above rollout.mismatch_stop=1.2" in message and "\n" not in message


def test_above_the_warn_threshold_one_warning_line_and_the_run_goes_on(capsys):
    check_mismatch(state(mismatch_warn=1.1), METRICS)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("mcore-rl: warning: step 7:")
    assert "above rollout.mismatch_warn=1.1" in out[0]
    check_mismatch(state(mismatch_warn=1.3, mismatch_stop=1.3), METRICS)  # below both
    check_mismatch(state(mismatch_stop=1.0), {})  # no fresh token this step: nothing to judge
    assert capsys.readouterr().out == ""


def test_thresholds_below_one_are_refused_as_the_error_is_at_least_one():
    with pytest.raises(ConfigError, match="rollout.mismatch_stop must be >= 1, got 0.5"):
        check_ranges(load_config(None, ["rollout.mismatch_stop=0.5"]))
