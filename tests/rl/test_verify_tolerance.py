"""The weight-sync verification tolerance follows the model's precision unless set."""
import pytest

from mcore_rl.config import load_config
from mcore_rl.rl.phases import verify_tolerance


@pytest.mark.parametrize("overrides, expected", [
    ([], 0.05),                                               # fp32: engine and trainer agree to ~1e-5
    (["model.dtype=bf16"], 1.0),                              # bf16 logits round to ~0.1
    (["model.dtype=bf16", "reshard.verify_tolerance=0.2"], 0.2),
    (["reshard.verify_tolerance=0.001"], 0.001),
])
def test_default_depends_on_dtype_and_an_explicit_value_wins(overrides, expected):
    assert verify_tolerance(load_config(None, overrides)) == expected
