"""The bucket wire format: checksums catch corruption, readers assemble tensors from pieces."""
import pytest
import torch

from mcore_rl.wire import (BucketChecksumError, check_manifest, checksum, copy_and_checksum,
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


def _reference_sum64(data: torch.Tensor) -> list[int]:
    """sum64 by its definition, word by word in Python (int64 wrap-around)."""
    raw, start = data.tolist(), data.storage_offset()
    head = min(-start % 8, len(raw))
    n_words = (len(raw) - head) // 8
    loose = raw[:head] + raw[head + 8 * n_words:]
    words = [int.from_bytes(bytes(raw[head + 8 * i:head + 8 * i + 8]), "little", signed=True)
             for i in range(n_words)]
    rows = [sum(words[b:b + 512]) for b in range(0, n_words // 512 * 512, 512)]
    rows.append(sum(words[n_words // 512 * 512:]) + sum(loose))
    wrap = lambda x: (x + 2**63) % 2**64 - 2**63  # noqa: E731
    return [wrap(sum(rows)), wrap(sum((i + 1) * r for i, r in enumerate(rows)))]


@pytest.mark.parametrize("offset, nbytes", [(0, 0), (3, 5), (1, 13), (0, 4096), (8, 3 * 4096 + 20),
                                            (5, 2 * 4096 + 7)])
def test_sum64_follows_its_definition(offset, nbytes):
    data = torch.randint(0, 256, (offset + nbytes,), dtype=torch.uint8)
    data[offset::3] = 0xFF  # large words: the sums wrap around
    assert checksum(data[offset:]) == _reference_sum64(data[offset:])


@pytest.mark.parametrize("wire, source", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("numel", [5, 4 * 2**20 + 3, 6 * 2**20])
@pytest.mark.parametrize("offset", [0, 64, 4])
def test_copy_and_checksum_equals_a_copy_then_its_checksum(wire, source, numel, offset):
    src = torch.randn(numel).to(source)
    size = torch.empty((), dtype=wire).element_size()
    raw = torch.zeros(offset + numel * size, dtype=torch.uint8)
    dst = raw[offset:].view(wire)
    got = copy_and_checksum(dst, src)
    assert torch.equal(dst, src.to(wire)) and got == checksum(dst)


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


def test_engines_map_the_file_read_only_so_a_stray_write_faults_instead_of_changing_weights(tmp_path):
    import signal
    import subprocess
    import sys

    path = tmp_path / "file"
    create_bucket_file(path, 4096)
    writer = map_bucket_file(path, 4096)
    writer[:8] = 7
    script = ("import sys; from mcore_rl.wire import BucketReader; "
              "b = BucketReader().open(sys.argv[1], 4096); "
              "assert int(b[:8].sum()) == 56, 'the reader sees the writer'; print('read', flush=True); "
              "b[0] = 1")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True)
    assert proc.stdout.strip() == "read", proc.stderr
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-500:])
    assert writer[:8].tolist() == [7] * 8
