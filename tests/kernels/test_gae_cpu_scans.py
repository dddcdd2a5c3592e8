"""The CPU GAE path on masks with holes (and long rows), and its two blockwise scans, against loops.

Masks with holes (masked steps between valid ones, e.g. tool outputs in a multi-turn response)
take a different route through ``gae_cpu`` than padded masks; these cases are drawn at random
(hole density, padding on either side, empty rows, discounts from 0 to 1, lengths across
several block levels) and compared with the per-step reference loop in fp64.
"""
from __future__ import annotations

import pytest
import torch

from mcore_rl.kernels.gae import gae_cpu, gae_reference
from mcore_rl.kernels.gae.cpu import discounted_suffix_sum, linked_suffix_sum
from tests.kernels.helpers import GAE_TOL

FP64_TOL = (1e-12, 1e-12)
# (gamma, lam): c = gamma * lam at 0, tiny, just below / above the fp32 scan's range limit
# (c^16 = 1e-12 at c ~ 0.178), typical, close to 1 and 1
DISCOUNTS = [(0.99, 0.95), (1.0, 1.0), (0.999, 0.97), (0.9, 0.2), (0.5, 0.3), (0.2, 0.05), (0.0, 0.9), (0.9, 0.0)]


def random_holed_mask(batch: int, steps: int, g: torch.Generator) -> torch.Tensor:
    """0/1 fp32 [B, T]: per row a random hole density, left and right padding, some rows
    empty or with a single valid step, some with a hole every k steps."""
    m = torch.empty(batch, steps)
    for b in range(batch):
        kind = int(torch.randint(0, 8, (), generator=g))
        density = float(torch.rand((), generator=g)) * 0.9
        row = (torch.rand(steps, generator=g) >= density).float()
        if kind == 0:
            row.zero_()
        elif kind == 1:
            row.zero_()
            row[int(torch.randint(0, steps, (), generator=g))] = 1
        elif kind == 2:
            row.fill_(1)
            row[int(torch.randint(1, 8, (), generator=g)) - 1 :: int(torch.randint(2, 9, (), generator=g))] = 0
        lo, hi = sorted(torch.randint(0, steps + 1, (2,), generator=g).tolist())
        if kind >= 5:  # padding on both sides of a holed response
            row[:lo] = 0
            row[hi:] = 0
        m[b] = row
    return m


def assert_matches_reference(r, v, m, gamma, lam, dtype):
    adv, ret = gae_cpu(r.to(dtype), v.to(dtype), m, gamma, lam)
    ref_adv, ref_ret = gae_reference(r.double(), v.double(), m, gamma, lam)
    rtol, atol = GAE_TOL if dtype == torch.float32 else FP64_TOL
    assert adv.dtype == ret.dtype == dtype
    torch.testing.assert_close(adv, ref_adv.to(dtype), rtol=rtol, atol=atol)
    torch.testing.assert_close(ret, ref_ret.to(dtype), rtol=rtol, atol=atol)
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("seed", range(24))
def test_random_holed_masks_match_reference(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 7, (), generator=g))
    steps = int(torch.randint(3, 700, (), generator=g))
    gamma, lam = DISCOUNTS[seed % len(DISCOUNTS)]
    r, v = torch.randn(batch, steps, generator=g) * 3, torch.randn(batch, steps, generator=g) * 3
    m = random_holed_mask(batch, steps, g)
    m[0, 0], m[0, 1], m[0, 2] = 1, 0, 1  # at least one hole: the holed route is taken
    assert_matches_reference(r, v, m, gamma, lam, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("holes", [False, True], ids=["padded", "holes"])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 0.9), (0.999, 0.97), (0.2, 0.05)])
def test_long_rows_match_reference(gamma, lam, holes, dtype):
    # 6001 steps: four block levels and a length that is not a multiple of the block. Padded:
    # at c = 0.969 the third level still carries c^256 ~ 3e-4 between blocks. Holes: the block
    # starts are solved in one fp64 pass while c^T stays above 1e-270 (c = 0.94, 0.969), else
    # blockwise again, in fp32 (c = 0.9) or fp64 (c = 0.01)
    g = torch.Generator().manual_seed(7)
    r, v = torch.randn(3, 6001, generator=g), torch.randn(3, 6001, generator=g)
    m = (torch.arange(6001) < torch.tensor([[6001], [3001], [17]])).float()
    if holes:
        m[:, 3::7] = 0
    assert_matches_reference(r, v, m, gamma, lam, dtype)


def test_holes_every_other_step_and_isolated_valid_steps():
    g = torch.Generator().manual_seed(11)
    r, v = torch.randn(4, 97, generator=g), torch.randn(4, 97, generator=g)
    m = torch.zeros(4, 97)
    m[0, ::2] = 1
    m[1, 1::2] = 1
    m[2, [5, 40, 96]] = 1
    m[3, 30:60] = 1
    m[3, 45] = 0
    for gamma, lam in DISCOUNTS:
        assert_matches_reference(r, v, m, gamma, lam, torch.float32)
        assert_matches_reference(r, v, m, gamma, lam, torch.float64)


def linked_loop(y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(y)
    h = torch.zeros(y.shape[0], dtype=y.dtype)
    for t in range(y.shape[1] - 1, -1, -1):
        h = y[:, t] + (d[:, t + 1] * h if t + 1 < y.shape[1] else 0)
        out[:, t] = h
    return out


@pytest.mark.parametrize("steps", [1, 5, 16, 17, 256, 300, 4097])
@pytest.mark.parametrize(
    "dtype,floor",
    [(torch.float32, 0.2), (torch.float64, 0.5), (torch.float64, 1e-17)],
    ids=["fp32", "fp64", "fp64-tiny-links"],
)
def test_linked_suffix_sum_matches_loop(steps, dtype, floor):
    g = torch.Generator().manual_seed(steps)
    y = torch.randn(3, steps, generator=g, dtype=torch.float64)
    # links in [floor, 1], a third of them exactly 1 (masked steps pass values on unchanged)
    d = floor + (1 - floor) * torch.rand(3, steps, generator=g, dtype=torch.float64) ** 4
    d[torch.rand(3, steps, generator=g) < 0.3] = 1
    expected = linked_loop(y, d)
    got = linked_suffix_sum(y.to(dtype), d.to(dtype), floor, torch.empty(3, steps, dtype=dtype))
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-12, 1e-12)
    torch.testing.assert_close(got, expected.to(dtype), rtol=rtol, atol=atol)


@pytest.mark.parametrize("c", [0.0, 1e-3, 0.01, 0.5, 0.969, 1.0])
def test_discounted_suffix_sum_matches_loop(c):
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, 4100, generator=g, dtype=torch.float64)
    expected = linked_loop(y, torch.full_like(y, c))
    torch.testing.assert_close(discounted_suffix_sum(y, c), expected, rtol=1e-12, atol=1e-12)
