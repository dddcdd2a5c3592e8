"""The weight-sync wire protocol: what trainer ranks write and engine processes read.

A sync streams the model through one file in a tmpfs (RAM, no disk), bucket by bucket.
Trainer ranks write their pieces into it (`bucket_file`) and checksum them (`checksum`);
the engine's processes map the same file and, per bucket, check and read the tensors its
*manifest* describes (`manifest`). HF tensors of one engine module never straddle buckets
(`modules`). Both sides import this package and nothing else of each other: it depends on
torch and numpy only.
"""
from mcore_rl.wire.bucket_file import (ALIGN, BucketReader, align, create_bucket_file,
                                       map_bucket_file, piece_view, remove_bucket_file)
from mcore_rl.wire.checksum import CHECKSUMS, checksum, copy_and_checksum
from mcore_rl.wire.errors import BucketChecksumError, WeightSyncError
from mcore_rl.wire.manifest import DTYPE_NAMES, DTYPES, back_to_back, check_manifest, read_tensors
from mcore_rl.wire.modules import engine_module

__all__ = ["ALIGN", "BucketChecksumError", "BucketReader", "CHECKSUMS", "DTYPES", "DTYPE_NAMES",
           "WeightSyncError", "align", "back_to_back", "check_manifest", "checksum",
           "copy_and_checksum", "create_bucket_file", "engine_module", "map_bucket_file",
           "piece_view", "read_tensors", "remove_bucket_file"]
