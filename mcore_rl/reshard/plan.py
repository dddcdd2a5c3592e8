"""`ReshardPlan`: which trainer rank writes which slice of which HF tensor, into which bucket.

Computed once per run from what every trainer rank holds (`Holding`, read from Megatron's
sharded state dict, so TP, PP, VPP and DP placement come from Megatron itself, not from
layout arithmetic repeated here). Legend: nq query heads, ng KV groups, d head_dim,
qpg = nq/ng query heads per group, h hidden, f FFN size, V vocab, Vp padded vocab.

Who writes: the rank holding Megatron's *main replica* of a region (``replica_id`` all 0).
That is dp_rank 0 only (DP replicas never duplicate), tp_rank 0 for tensors replicated over
TP (norms), the first stage for a tied embedding (the last stage's copy is a replica, so a
tied embedding is sent once), and each TP rank for its own shard of a split tensor.

What it writes, per Megatron tensor (one layer):
- ``linear_qkv`` shard [ng_t * (qpg + 2) * d, h] (whole query groups g0..g1) -> three pieces:
  rows g0*qpg*d.. of ``q_proj``, rows g0*d.. of ``k_proj`` and of ``v_proj`` (same for the
  Qwen2 bias). GQA needs no gather: each TP rank's groups are contiguous rows of q, k and v.
- ``linear_fc1`` holdings are [gate_t] and [up_t] (Megatron's factory) -> rows of gate/up_proj.
- embedding / untied ``output_layer`` rows [r0, r1) -> rows [r0, min(r1, V)) of the HF
  tensor: vocabulary padding is stripped by not writing it.
- row-parallel ``linear_proj`` / ``linear_fc2`` [h, n/tp] -> column blocks (axis 1), joined
  by the reader; everything else is written whole by its one main holder.
- experts (mixture of experts): each holding is one expert of one layer (Megatron's sharded
  state dict stacks them on a layer and a global expert axis), cut like the dense fc1/fc2
  into that expert's HF ``gate``/``up``/``down`` tensors; the EP rank holding the expert
  writes it.

No TP gather happens on the trainer: every TP rank writes its own shard straight into the
shared bucket, where axis-0 pieces land back to back and form the HF tensor in place. Only
row-parallel weights split by trainer TP arrive as column blocks, concatenated once by the
engine-side reader. Tensors go out under HF names, unfused: the engine's own loader fuses
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` *per engine TP shard* (a shard of
``qkv_proj`` is [q_r; k_r; v_r], not a slice of cat(q, k, v)), which is what makes one
plan serve every engine TP size (`mcore_rl.engines.param_plan` describes those fused
engine parameters).

Units and buckets: the HF tensors of one engine module (q, k, v [+ biases] of one
``qkv_proj``; gate and up of one ``gate_up_proj``; any other tensor alone) form a *unit*
that never straddles buckets, so the engine completes each module from one bucket. Units
are packed layer by layer into buckets of at most ``bucket_bytes`` (a unit larger than that
gets a bucket of its own). Two consecutive buckets are in flight at once (writers fill
bucket k+1 while the engine loads bucket k), so buckets alternate between the front and
the back of the file, whose size is the largest sum of two consecutive buckets. A transport
may place the pieces elsewhere (`mcore_rl.reshard.transports`): the shared transport points
them at the trainer's parameters themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mcore_rl.models.arch import ModelArch
from mcore_rl.models.mapping import (GATE_UP, QKV, VOCAB, TensorMapping, ffn_size, hf_shapes,
                                     tensor_mappings)
from mcore_rl.wire import DTYPE_NAMES, align, engine_module


@dataclass(frozen=True)
class Holding:
    """One region of one Megatron tensor held by one trainer rank."""

    rank: int
    key: str
    """Megatron sharded-state-dict key."""
    layer: int | None
    """Global layer index (None for non-layer tensors)."""
    offsets: tuple[int, ...]
    """Offsets of the region within the one-layer global tensor."""
    shape: tuple[int, ...]
    """Shape of the region (the rank's local tensor)."""
    main: bool
    """Megatron's main replica: the one holder that sends this region."""
    expert: int | None = None
    """Global expert index of an expert tensor (its second stacked axis), else None."""

    @property
    def view_key(self) -> tuple:
        """How a rank finds the tensor of this holding among its views."""
        if self.expert is None:
            return (self.key, self.layer, self.offsets)
        return (self.key, self.layer, self.expert, self.offsets)


@dataclass(frozen=True)
class Piece:
    """A contiguous part of one HF tensor, cut from one holding and written by its rank."""

    holding: Holding
    select: tuple
    """How to cut it from the holding: ``("all",)``, ``("rows", n)`` or ``("qkv", a, b)``
    (rows a..b of every query group of a ``linear_qkv`` shard)."""
    hf_name: str
    axis: int
    """Axis of the HF tensor the pieces of this tensor tile (1: row-parallel column blocks)."""
    start: int
    """Index along ``axis`` where the piece begins in the HF tensor."""
    shape: tuple[int, ...]
    offset: int = -1
    """Byte offset in its bucket (set when packed), or in the shared parameter file."""
    layout: tuple | None = None
    """Shared transport: (view shape, strides) in elements where the piece is a strided part
    of its parameter (q/k/v rows of ``linear_qkv``); None: contiguous."""

    @property
    def rank(self) -> int:
        return self.holding.rank

    def nbytes(self, dtype: torch.dtype) -> int:
        return _nbytes(self.shape, dtype)

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """This piece's part of ``x``, its holding's tensor (a view)."""
        kind = self.select[0]
        if kind == "rows":
            return x[:self.select[1]]
        if kind == "qkv":
            a, b = self.select[1:]
            return x.view(self.shape[0] // (b - a), -1, *x.shape[1:])[:, a:b]
        return x


@dataclass
class TensorEntry:
    """One HF tensor of a bucket: where its pieces lie."""

    hf_name: str
    shape: tuple[int, ...]
    axis: int
    pieces: list[Piece]
    offset: int = 0
    nbytes: int = 0


@dataclass
class Bucket:
    index: int
    tensors: list[TensorEntry] = field(default_factory=list)
    nbytes: int = 0
    regions: list[tuple[int, int, int]] = field(default_factory=list)
    """Shared transport: (offset, nbytes, rank) of the file's byte ranges its pieces lie in
    (each rank's holdings merged where they are adjacent, cut into runs of at most
    ``transports.shared_file.REGION_BYTES``); the writing rank checksums each, the engine
    checks them."""


def _cuts(h: Holding, m: TensorMapping, arch: ModelArch) -> list[tuple[str, tuple, int, int, tuple]]:
    """(hf name, select, axis, start, shape) of the HF pieces one holding contains."""
    names = m.hf_names_for(h.layer, h.expert)
    rest = h.shape[1:]
    if m.fusion == QKV:
        d, qpg = arch.kv_channels, arch.num_attention_heads // arch.num_kv_heads
        per_group = (qpg + 2) * d
        g0, groups = h.offsets[0] // per_group, h.shape[0] // per_group
        parts = [(0, qpg * d, g0 * qpg * d), (qpg * d, (qpg + 1) * d, g0 * d),
                 ((qpg + 1) * d, per_group, g0 * d)]
        return [(name, ("qkv", a, b), 0, start, (groups * (b - a), *rest))
                for name, (a, b, start) in zip(names, parts)]
    if m.fusion == GATE_UP:
        f, r0 = ffn_size(m, arch), h.offsets[0]
        name, start = (names[0], r0) if r0 < f else (names[1], r0 - f)
        return [(name, ("all",), 0, start, h.shape)]
    if m.fusion == VOCAB:
        r0, rows = h.offsets[0], min(h.shape[0], arch.vocab_size - h.offsets[0])
        return [(names[0], ("rows", rows), 0, r0, (rows, *rest))] if rows > 0 else []
    axis = m.tp_axis if m.tp_axis is not None else 0
    return [(names[0], ("all",), axis, h.offsets[axis] if h.offsets else 0, h.shape)]


def _hf_order(arch: ModelArch, head: str) -> list[str]:
    """HF tensor names layer by layer (embedding, layer 0..L-1, final norm, head)."""
    mappings = tensor_mappings(arch, head)
    first = [n for m in mappings if not m.per_layer and m.mcore_key.startswith("embedding")
             for n in m.hf_names_for(None)]
    last = [n for m in mappings if not m.per_layer and not m.mcore_key.startswith("embedding")
            for n in m.hf_names_for(None)]
    experts = range(arch.num_experts)
    layers = [n for layer in range(arch.num_layers) for m in mappings if m.per_layer
              for expert in (experts if m.per_expert else [None])
              for n in m.hf_names_for(layer, expert)]
    return first + layers + last


@dataclass
class ReshardPlan:
    """Buckets of HF tensors and, for each, the pieces trainer ranks write (see module doc)."""

    arch: ModelArch
    wire_dtype: torch.dtype
    bucket_bytes: int
    buckets: list[Bucket]
    hf_shapes: dict[str, tuple[int, ...]]

    @classmethod
    def build(cls, holdings: list[Holding], arch: ModelArch, bucket_bytes: int,
              wire_dtype: torch.dtype = torch.float32, head: str = "lm") -> "ReshardPlan":
        """Plan from every rank's holdings. Raises ValueError unless the main replicas tile
        every HF tensor exactly once."""
        mappings = {m.mcore_key: m for m in tensor_mappings(arch, head)}
        shapes = {n: s for m in mappings.values() for index in m.instances(arch)
                  for n, s in zip(m.hf_names_at(index), hf_shapes(m, arch))}
        pieces: dict[str, list[Piece]] = {n: [] for n in shapes}
        for h in holdings:
            if h.main and h.key in mappings:
                for name, select, axis, start, shape in _cuts(h, mappings[h.key], arch):
                    pieces[name].append(Piece(h, select, name, axis, start, shape))
        entries = {n: _check_tiling(n, shapes[n], pieces[n]) for n in shapes}
        size = torch.empty((), dtype=wire_dtype).element_size()
        units: dict[str, list[TensorEntry]] = {}
        for name in _hf_order(arch, head):
            units.setdefault(engine_module(name), []).append(entries[name])
        buckets = _pack(list(units.values()), bucket_bytes, size)
        return cls(arch=arch, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes, buckets=buckets,
                   hf_shapes=shapes)

    @property
    def max_bucket_nbytes(self) -> int:
        return max(b.nbytes for b in self.buckets)

    @property
    def file_nbytes(self) -> int:
        """Size of a file that holds any two consecutive buckets where `build` placed them."""
        sizes = [b.nbytes for b in self.buckets]
        return max([sizes[0]] + [a + b for a, b in zip(sizes, sizes[1:])])

    @property
    def total_nbytes(self) -> int:
        return sum(t.nbytes for b in self.buckets for t in b.tensors)

    def pieces(self, bucket: int, rank: int | None = None) -> list[Piece]:
        """Pieces of a bucket (those written by ``rank`` when given)."""
        return [p for t in self.buckets[bucket].tensors for p in t.pieces
                if rank is None or p.rank == rank]

    def keyed_pieces(self, bucket: int, ranks) -> list[tuple[tuple[int, int], Piece]]:
        """``((tensor index, piece index), piece)`` of a bucket's pieces written by ``ranks``,
        in plan order; the key is how `manifest` finds each piece's checksum."""
        return [((ti, pi), p) for ti, t in enumerate(self.buckets[bucket].tensors)
                for pi, p in enumerate(t.pieces) if p.rank in ranks]

    def writers(self) -> set[int]:
        return {p.rank for b in range(len(self.buckets)) for p in self.pieces(b)}

    def manifest(self, bucket: int, sums: dict, version: int, algorithm: str) -> dict:
        """The plain-Python manifest of a bucket (`mcore_rl.wire.manifest`). ``sums`` are the
        writers' checksums: of each piece by ``(tensor index, piece index)``, or, where the
        bucket lists ``regions`` (pieces checksummed where they lie), of each region by its
        offset."""
        dtype, regions = DTYPE_NAMES[self.wire_dtype], self.buckets[bucket].regions
        tensors = []
        for ti, t in enumerate(self.buckets[bucket].tensors):
            if regions:
                pieces = [[p.offset, p.nbytes(self.wire_dtype), list(p.shape), None,
                           None if p.layout is None else [list(p.layout[0]), list(p.layout[1])]]
                          for p in t.pieces]
            else:
                pieces = [[p.offset, p.nbytes(self.wire_dtype), list(p.shape),
                           sums[(ti, pi)]] for pi, p in enumerate(t.pieces)]
            tensors.append([t.hf_name, dtype, list(t.shape), t.axis, pieces])
        out = {"bucket": bucket, "num_buckets": len(self.buckets), "version": version,
               "checksum": algorithm, "tensors": tensors}
        if regions:
            out["regions"] = [[at, n, sums[at]] for at, n, _ in regions]
        return out

    def summary(self) -> str:
        return (f"{len(self.buckets)} buckets, {self.total_nbytes / 2**20:.1f} MiB, largest "
                f"{self.max_bucket_nbytes / 2**20:.1f} MiB, file {self.file_nbytes / 2**20:.1f} MiB, "
                f"writers {sorted(self.writers())}")


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _check_tiling(name: str, shape: tuple[int, ...], pieces: list[Piece]) -> TensorEntry:
    if not pieces:
        raise ValueError(f"no trainer rank holds the main replica of {name}")
    axes = {p.axis for p in pieces}
    if len(axes) != 1:
        raise ValueError(f"{name}: pieces split along several axes {sorted(axes)}")
    axis = axes.pop()
    pieces = sorted(pieces, key=lambda p: p.start)
    at = 0
    for p in pieces:
        other = [n for a, n in enumerate(p.shape) if a != axis]
        if p.start != at or other != [n for a, n in enumerate(shape) if a != axis]:
            raise ValueError(f"{name}: pieces do not tile the tensor (piece at {p.start}, "
                             f"shape {list(p.shape)}; expected to start at {at})")
        at += p.shape[axis]
    if at != shape[axis]:
        raise ValueError(f"{name}: pieces cover {at} of {shape[axis]} along axis {axis}")
    return TensorEntry(name, shape, axis, pieces)


def _pack(units: list[list[TensorEntry]], bucket_bytes: int, size: int) -> list[Bucket]:
    buckets = [Bucket(0)]
    for unit in units:
        unit_bytes = sum(align(_numel(t.shape) * size) for t in unit)
        if buckets[-1].tensors and buckets[-1].nbytes + unit_bytes > bucket_bytes:
            buckets.append(Bucket(len(buckets)))
        bucket = buckets[-1]
        for t in unit:
            t.offset, at = bucket.nbytes, bucket.nbytes
            packed = []
            for p in t.pieces:  # back to back: axis-0 pieces form the tensor in place
                packed.append(replace(p, offset=at))
                at += _numel(p.shape) * size
            t.pieces, t.nbytes = packed, at - t.offset
            bucket.tensors.append(t)
            bucket.nbytes = align(at)
    _alternate_front_and_back(buckets)
    return buckets


def _alternate_front_and_back(buckets: list[Bucket]) -> None:
    """Move odd buckets to the end of the file, so consecutive buckets never overlap."""
    sizes = [b.nbytes for b in buckets]
    file_bytes = max([sizes[0]] + [a + b for a, b in zip(sizes, sizes[1:])])
    for b in buckets[1::2]:
        shift = file_bytes - b.nbytes
        for t in b.tensors:
            t.offset += shift
            t.pieces = [replace(p, offset=p.offset + shift) for p in t.pieces]


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())
