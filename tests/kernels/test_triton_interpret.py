"""The Triton kernels, run by Triton's CPU interpreter on small shapes, match the references.

The interpreter must be switched on before the kernels are imported and must stay off for the
rest of the session, so the kernels run in one subprocess (``triton_interpret_cases.py``) that
saves (kernel output, reference) pairs; the assertions and tolerances live here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.helpers import GAE_TOL, TOL

pytest.importorskip("triton", reason="the Triton kernels need the triton package")  # installed in CI

ROOT = Path(__file__).resolve().parents[2]
TOLERANCES = {
    "logp": lambda dtype: TOL[dtype]["logp"],
    "grad": lambda dtype: TOL[dtype]["grad"],
    "linear": lambda dtype: (1e-4, 1e-5),
    "gae": lambda dtype: GAE_TOL,
    "exact": lambda dtype: (0.0, 0.0),
}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton_interpret_cases", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def _check(results: dict, prefix: str) -> int:
    n = 0
    for key, (ours, ref, dtype, kind) in results.items():
        if not key.startswith(prefix):
            continue
        rtol, atol = TOLERANCES[kind](dtype)
        assert ours.shape == ref.shape, key
        torch.testing.assert_close(ours.float(), ref.float(), rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
        n += 1
    assert n > 0, f"no results for {prefix}"
    return n


def test_triton_token_logprobs_matches_reference_fp32_bf16_padded_vocab_temperature(interpreted):
    _check(interpreted, "logprobs/")


def test_triton_inplace_backward_reuses_the_logits_buffer(interpreted):
    _check(interpreted, "logprobs/inplace-backward/")


def test_triton_truncated_logprobs_backward_matches_reference(interpreted):
    _check(interpreted, "truncated/")


def test_triton_linear_token_logprobs_matches_reference(interpreted):
    _check(interpreted, "linear/")


def test_triton_gae_matches_reference_over_mask_patterns(interpreted):
    _check(interpreted, "gae/")


def test_triton_gae_packed_matches_reference(interpreted):
    _check(interpreted, "gae_packed/")
