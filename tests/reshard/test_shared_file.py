"""The shared transport: parameters moved into a shared file stay the optimizer's parameters,
another mapping of the file sees every update, and what cannot be shared is named.

Oracle: a second, independent mapping of the same file (what the engine's process holds),
and plain copies of the parameters taken before the move.
"""
from dataclasses import replace

import pytest
import torch

from mcore_rl.reshard.plan import Holding
from mcore_rl.reshard.transports.shared_file import (move_parameters, region_nbytes,
                                                     sent_parameters, shared_transport_problem)
from mcore_rl.wire import (BucketChecksumError, check_manifest, checksum, create_bucket_file,
                           map_bucket_file, read_tensors)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)


def _holdings(params, main=True):
    """One holding per parameter (as Megatron's sharded state dict gives them)."""
    holdings, views = [], {}
    for i, p in enumerate(params):
        h = Holding(0, f"p{i}", None, (0,) * p.dim(), tuple(p.shape), main)
        holdings.append(h)
        views[(h.key, h.layer, h.offsets)] = p.data
    return holdings, views


def _file(tmp_path, nbytes):
    path = tmp_path / "weights"
    create_bucket_file(path, nbytes, allocate=False)
    return path, map_bucket_file(path, nbytes)


def test_moved_parameters_are_still_the_ones_the_optimizer_updates_and_the_file_shows_it(tmp_path):
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    holdings, views = _holdings(params)
    assert shared_transport_problem(params, holdings, views, torch.float32) is None
    sent = sent_parameters(params, holdings, views)
    assert [id(p) for p in sent] == [id(p) for p in params]
    path, buffer = _file(tmp_path, region_nbytes(sent))
    move_parameters(sent, buffer, 0)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    other = map_bucket_file(path, region_nbytes(sent))  # the engine's own mapping
    first = other[:params[0].numel() * 4].view(torch.float32).view(params[0].shape)
    assert torch.equal(first, before[0])

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(params[0], before[0]), "the step must change the weight"
    assert torch.equal(first, params[0]), "the other mapping sees the update in place"
    assert params[0].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_strided_pieces_are_read_in_place_and_regions_checked(tmp_path):
    # a [2 groups x (q 2 rows, k 1 row), 3] weight: q is rows 0-1 and 3-4, k rows 2 and 5
    w = torch.arange(18, dtype=torch.float32).view(6, 3)
    path, buffer = _file(tmp_path, w.numel() * 4)
    buffer.view(torch.float32)[:18] = w.reshape(-1)
    q = [0, 24, [4, 3], None, [[2, 2, 3], [9, 3, 1]]]
    k = [24, 12, [2, 3], None, [[2, 1, 3], [9, 3, 1]]]
    manifest = {"bucket": 0, "num_buckets": 1, "version": 2, "checksum": "sum64",
                "tensors": [["q", "float32", [4, 3], 0, [q]], ["k", "float32", [2, 3], 0, [k]]],
                "regions": [[0, 72, checksum(buffer[:72])]]}
    check_manifest(buffer, manifest)
    tensors = dict(read_tensors(buffer, manifest))
    assert torch.equal(tensors["q"], w[[0, 1, 3, 4]]) and torch.equal(tensors["k"], w[[2, 5]])
    buffer[70] ^= 0x08
    with pytest.raises(BucketChecksumError, match="region at byte 0 .*holding q, k"):
        check_manifest(buffer, manifest)


def test_what_cannot_be_shared_is_named():
    params = list(_model().parameters())
    holdings, views = _holdings(params)
    assert "torch.float32, the engine takes torch.bfloat16" in shared_transport_problem(
        params, holdings, views, torch.bfloat16)
    flat = torch.zeros(sum(p.numel() for p in params))  # Megatron's distributed optimizer
    at = 0
    for p in params:
        p.data = flat[at:at + p.numel()].view(p.shape)
        at += p.numel()
    holdings, views = _holdings(params)
    assert "views of one flat buffer" in shared_transport_problem(params, holdings, views,
                                                                  torch.float32)
    copies = {key: v.clone() for key, v in views.items()}  # a holding that is no parameter
    assert "not a parameter's own memory" in shared_transport_problem(params, holdings, copies,
                                                                      torch.float32)


def test_only_parameters_behind_main_holdings_are_moved():
    params = list(_model().parameters())
    holdings, views = _holdings(params)
    holdings = [h if i % 2 else replace(h, main=False)
                for i, h in enumerate(holdings)]
    assert [id(p) for p in sent_parameters(params, holdings, views)] == \
        [id(p) for i, p in enumerate(params) if i % 2]


def test_a_tmpfs_without_room_is_refused_before_anything_is_written(tmp_path):
    from mcore_rl.reshard.transports.shm_file import room_problem

    assert room_problem(str(tmp_path), 1, "the bucket file", "") is None
    assert "is not a directory" in room_problem(str(tmp_path / "missing"), 1, "the file", "")
    problem = room_problem(str(tmp_path), 1 << 60, "the bucket file", "lower reshard.bucket_mb")
    assert "the bucket file needs" in problem and " free: lower reshard.bucket_mb" in problem
    assert "--shm-size" in problem


def test_regions_merge_where_parameters_follow_each_other_and_are_cut_into_bounded_runs():
    from mcore_rl.reshard.transports.shared_file import REGION_BYTES, _runs

    # rank 0: two parameters with 60 bytes of alignment padding between them, then one past
    # a 64-byte gap; rank 1 right after it; then a run longer than REGION_BYTES
    regions = [(0, 100, 0), (160, 40, 0), (264, 8, 0), (272, 8, 1),
               (1024, 2 * REGION_BYTES + 8, 1)]
    assert _runs(regions) == [(0, 200, 0), (264, 8, 0), (272, 8, 1),
                              (1024, REGION_BYTES, 1), (1024 + REGION_BYTES, REGION_BYTES, 1),
                              (1024 + 2 * REGION_BYTES, 8, 1)]
