"""GAE: the reference against a hand-computed case, the fast torch path against the reference."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.kernels import gae, gae_packed
from mcore_rl.kernels.gae import gae_reference
from tests.kernels.helpers import GAE_TOL, gae_inputs


def test_reference_matches_hand_computed_masked_case():
    # row 0: valid steps 0 and 2 (hole at 1); row 1: fully masked; row 2: only step 1 valid
    r = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [7.0, 1.0, 9.0]])
    v = torch.tensor([[0.5, 1.0, 1.5], [1.0, 1.0, 1.0], [3.0, 2.0, 4.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0]])
    gamma, lam = 0.9, 0.8
    # row 0: delta_2 = 3 - 1.5 = 1.5 = A_2; delta_0 = 1 + 0.9 * 1.5 - 0.5 = 1.85,
    #        A_0 = 1.85 + 0.72 * 1.5 = 2.93; returns = A + V on valid steps
    # row 2: A_1 = 1 - 2 = -1 (no next valid step), returns -1 + 2 = 1
    adv, ret = gae_reference(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor([[2.93, 0, 1.5], [0, 0, 0], [0, -1.0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[3.43, 0, 3.0], [0, 0, 0], [0, 1.0, 0]]))


PATTERNS = ["full", "right", "left", "holes", "mixed"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    "batch,steps,gamma,lam",
    [
        pytest.param(4, 1, 0.99, 0.95, id="T=1"),
        pytest.param(5, 2, 0.9, 0.8, id="T=2"),
        pytest.param(6, 37, 0.99, 0.95, id="T=37"),
        pytest.param(3, 300, 1.0, 1.0, id="T=300-undiscounted"),
        pytest.param(4, 513, 0.999, 0.97, id="T=513-three-block-levels"),
        pytest.param(5, 40, 0.5, 0.0, id="lam=0"),
        pytest.param(5, 40, 0.0, 0.9, id="gamma=0"),
    ],
)
def test_cpu_path_matches_reference(batch, steps, gamma, lam, pattern):
    r, v, m = gae_inputs(batch, steps, pattern, seed=steps)
    adv, ret = gae(r, v, m, gamma, lam, impl="cpu")
    ref_adv, ref_ret = gae_reference(r.double(), v.double(), m, gamma, lam)
    rtol, atol = GAE_TOL
    torch.testing.assert_close(adv, ref_adv.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(ret, ref_ret.float(), rtol=rtol, atol=atol)
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)


def test_masked_rewards_are_ignored():
    r, v, m = gae_inputs(4, 50, "holes", seed=1)
    noisy = torch.where(m.bool(), r, torch.full_like(r, 1e6))
    for impl in ("reference", "cpu"):
        a1, r1 = gae(r, v, m, 0.99, 0.95, impl=impl)
        a2, r2 = gae(noisy, v, m, 0.99, 0.95, impl=impl)
        torch.testing.assert_close(a1, a2, rtol=0, atol=0)
        torch.testing.assert_close(r1, r2, rtol=0, atol=0)


def test_cpu_path_accepts_bool_mask_bf16_inputs_and_fp64():
    r, v, m = gae_inputs(3, 20, "holes", seed=2)
    ref_adv, _ = gae_reference(r.double(), v.double(), m, 0.99, 0.95)
    adv64, _ = gae(r.double(), v.double(), m.bool(), 0.99, 0.95, impl="cpu")
    assert adv64.dtype == torch.float64
    torch.testing.assert_close(adv64, ref_adv, rtol=1e-12, atol=1e-12)
    adv16, _ = gae(r.bfloat16(), v.bfloat16(), m.bool(), 0.99, 0.95, impl="cpu")
    expected16, _ = gae_reference(r.bfloat16(), v.bfloat16(), m.bool(), 0.99, 0.95)
    assert adv16.dtype == torch.float32
    torch.testing.assert_close(adv16, expected16, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_packed_equals_gae_of_each_sequence(impl, with_mask):
    lengths = [3, 0, 1, 17, 40]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    total = int(cu[-1])
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(total, generator=g), torch.randn(total, generator=g)
    m = (torch.rand(total, generator=g) > 0.3).float() if with_mask else torch.ones(total)
    adv, ret = gae_packed(r, v, cu, 0.99, 0.95, mask=m if with_mask else None, impl=impl)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e == s:
            continue
        ea, er = gae_reference(r[None, s:e].double(), v[None, s:e].double(), m[None, s:e], 0.99, 0.95)
        torch.testing.assert_close(adv[s:e], ea[0].float(), rtol=GAE_TOL[0], atol=GAE_TOL[1])
        torch.testing.assert_close(ret[s:e], er[0].float(), rtol=GAE_TOL[0], atol=GAE_TOL[1])


@pytest.mark.parametrize("cu", [[1, 5], [0, 4], [0, 6, 5]], ids=["not-from-0", "not-to-total", "decreasing"])
def test_packed_rejects_bad_cu_seqlens(cu):
    with pytest.raises(ValueError):
        gae_packed(torch.zeros(5), torch.zeros(5), torch.tensor(cu), 0.9, 0.9, impl="cpu")


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 0.9, 0.9)
