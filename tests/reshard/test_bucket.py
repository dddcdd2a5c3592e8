"""The bucket wire format: checksums catch corruption, readers assemble tensors from pieces."""
import pytest
import torch

from mcore_rl.reshard.bucket import (BucketChecksumError, check_manifest, checksum,
                                     create_bucket_file, map_bucket_file, piece_view, read_tensors)


@pytest.mark.parametrize("algorithm", ["sum64", "crc32"])
@pytest.mark.parametrize("offset, nbytes", [(0, 8 * 4096), (6, 8 * 4096 + 5), (3, 7)])
def test_every_single_bit_flip_changes_the_checksum(algorithm, offset, nbytes):
    data = torch.randint(0, 256, (offset + nbytes,), dtype=torch.uint8)
    piece = data[offset:]  # pieces may start at any element boundary
    reference = checksum(piece, algorithm)
    g = torch.Generator().manual_seed(0)
    for byte in torch.randint(0, nbytes, (50,), generator=g).tolist():
        bit = int(torch.randint(0, 8, (1,), generator=g))
        piece[byte] ^= 1 << bit
        assert checksum(piece, algorithm) != reference, (byte, bit)
        piece[byte] ^= 1 << bit
    assert checksum(piece, algorithm) == reference


def test_sum64_notices_blocks_that_were_written_in_the_wrong_place():
    words = torch.randint(-2**62, 2**62, (4 * 512,), dtype=torch.int64)
    swapped = torch.cat([words[512:1024], words[:512], words[1024:]])
    assert checksum(words) != checksum(swapped)


def _bucket(tmp_path, tensors):
    """Write ``tensors`` ([(name, [pieces], axis)]) into a bucket file; its manifest."""
    nbytes = sum(p.numel() * p.element_size() for _, pieces, _ in tensors for p in pieces)
    create_bucket_file(tmp_path / "b", nbytes)
    buffer = map_bucket_file(tmp_path / "b", nbytes)
    entries, at = [], 0
    for name, pieces, axis in tensors:
        records = []
        for p in pieces:
            n = p.numel() * p.element_size()
            piece_view(buffer, at, n, p.dtype, p.shape).copy_(p)
            records.append([at, n, list(p.shape), checksum(buffer[at:at + n])])
            at += n
        shape = list(torch.cat(pieces, dim=axis).shape)
        entries.append([name, "float32", shape, axis, records])
    return buffer, {"bucket": 0, "num_buckets": 1, "version": 4, "checksum": "sum64",
                    "tensors": entries}


def test_readers_join_row_blocks_in_place_and_column_blocks_by_concatenation(tmp_path):
    w = torch.randn(6, 4)
    buffer, manifest = _bucket(tmp_path, [("rows", [w[:2], w[2:]], 0),
                                          ("cols", [w[:, :1], w[:, 1:]], 1)])
    check_manifest(buffer, manifest)
    tensors = dict(read_tensors(buffer, manifest))
    assert torch.equal(tensors["rows"], w) and torch.equal(tensors["cols"], w)
    assert tensors["rows"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_a_corrupted_piece_is_named_in_the_error(tmp_path):
    buffer, manifest = _bucket(tmp_path, [("model.norm.weight", [torch.ones(8)], 0)])
    buffer[5] ^= 0x40
    with pytest.raises(BucketChecksumError, match="bucket 1/1 of weight version 4: piece 0 of "
                                                  "model.norm.weight"):
        check_manifest(buffer, manifest)
