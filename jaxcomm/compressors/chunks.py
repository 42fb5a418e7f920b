"""Chunks of a tensor and the compact codes of sparse, quantized parts of them.

The chunking of DeMo (Peng et al., 2024, arXiv:2411.19870, ``TransformDCT``) and SparseLoCo
(Sarfi et al., 2025, arXiv:2508.15706): a tensor is viewed as a matrix ``(rows, cols)``
(``(1, size)`` for a vector or a scalar, ``(shape[0], prod(shape[1:]))`` above two dims) and cut
into ``h x w`` tiles, ``h`` the largest divisor of ``rows`` that is ``<= chunk_size`` (1 for a
vector), ``w`` the largest divisor of ``cols`` that is ``<= chunk_size``. Tile ``t`` (row-major
over the tile grid) flattened row-major is chunk ``t``; an element's *offset* is its position in
its chunk, below ``h w <= chunk_size^2``.

Wire codes (little-endian bit order):

* :func:`pack_codes`: ``8 / bits`` codes of ``bits`` bits per byte, code ``j`` of a byte in its
  bits ``[bits j, bits (j + 1))``;
* :func:`pack_bits`: a stream of bits, bit ``i`` in bit ``i % 8`` of byte ``i // 8``; the
  ``k`` kept offsets of a chunk enter it by :func:`encode_offsets` in the shortest of three
  fixed-size codes (:func:`index_code`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ``<= limit`` (1 for ``n <= 1``)."""
    return max((d for d in range(1, min(n, limit) + 1) if n % d == 0), default=1)


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor is cut into chunks (static).

    Attributes:
      rows, cols: its matrix view.
      h, w: the tile (``h w`` elements per chunk).
      k: values kept per chunk (0 for an empty tensor).
    """

    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def length(self) -> int:
        """Elements per chunk."""
        return self.h * self.w

    @property
    def chunks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w) if self.size else 0

    @property
    def kept(self) -> int:
        """Values kept in the whole tensor."""
        return self.chunks * self.k


def chunk_plan(shape: tuple[int, ...], chunk_size: int, top_k: int) -> ChunkPlan:
    """The chunks of a tensor of ``shape``, keeping ``k = max(1, round(h w top_k /
    chunk_size^2))`` values per chunk (at most ``h w``): ``top_k`` per full square tile."""
    size = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = size // rows if rows else 0
    h = largest_divisor(rows, chunk_size) if len(shape) >= 2 else 1
    w = largest_divisor(cols, chunk_size)
    k = min(h * w, max(1, round(h * w * top_k / chunk_size**2))) if size else 0
    return ChunkPlan(rows, cols, h, w, k)


def to_chunks(x: jax.Array, plan: ChunkPlan) -> jax.Array:
    """The ``(chunks, h w)`` view of a tensor's ``(size,)`` values."""
    grid = x.reshape(plan.rows // plan.h, plan.h, plan.cols // plan.w, plan.w)
    return grid.transpose(0, 2, 1, 3).reshape(plan.chunks, plan.length)


def from_chunks(chunks: jax.Array, plan: ChunkPlan) -> jax.Array:
    """Inverse of :func:`to_chunks`: the tensor's ``(size,)`` values."""
    grid = chunks.reshape(plan.rows // plan.h, plan.cols // plan.w, plan.h, plan.w)
    return grid.transpose(0, 2, 1, 3).reshape(plan.size)


def chunk_positions(offsets: jax.Array, plan: ChunkPlan) -> jax.Array:
    """Positions in the tensor's ``(size,)`` values of ``offsets`` ``(..., chunks, k)``
    (int32), offset ``o`` of chunk ``t`` being element ``(o // w, o % w)`` of tile ``t``."""
    tiles_per_row = plan.cols // plan.w
    t = jnp.arange(plan.chunks, dtype=jnp.int32)[:, None]
    row = (t // tiles_per_row) * plan.h + offsets // plan.w
    col = (t % tiles_per_row) * plan.w + offsets % plan.w
    return row * plan.cols + col


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """``(K,)`` codes in ``[0, 2^bits)`` -> ``(ceil(K bits / 8),)`` uint8."""
    per = 8 // bits
    c = codes.astype(jnp.uint8)
    c = jnp.pad(c, (0, -c.shape[0] % per)).reshape(-1, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * np.uint8(bits)
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint8)


def unpack_codes(packed: jax.Array, bits: int, count: int) -> jax.Array:
    """Inverse of :func:`pack_codes` over the last axis: ``(..., count)`` int32."""
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * np.uint8(bits)
    codes = (packed[..., None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count].astype(jnp.int32)


def offset_width(plan: ChunkPlan) -> int:
    """Bits that hold any offset of a chunk: ``ceil(log2(h w))`` (0 for one-element chunks)."""
    return (plan.length - 1).bit_length()


def _low_bits(plan: ChunkPlan) -> int:
    """Elias-Fano's low bits per offset: ``floor(log2(h w / k))``."""
    return max(0, (plan.length // plan.k).bit_length() - 1)


def _code_bits(plan: ChunkPlan) -> dict[str, int]:
    """Bits per chunk of each offset code, in order of preference on a tie."""
    low = _low_bits(plan)
    return {
        "fields": plan.k * offset_width(plan),
        "mask": plan.length,
        "elias_fano": plan.k * (low + 1) + ((plan.length - 1) >> low) + 1,
    }


def index_code(plan: ChunkPlan) -> str:
    """How a chunk's ``k`` kept offsets travel, the shortest of (``L = h w``, ``b =
    ceil(log2 L)``, ``l = floor(log2(L / k))``):

    * ``"fields"``: ``k`` fields of ``b`` bits, in top-k order (``k b`` bits);
    * ``"mask"``: one bit per element, set where kept (``L`` bits);
    * ``"elias_fano"``: the ascending offsets' low ``l`` bits as ``k`` fields, then a
      ``k + (L - 1) >> l + 1``-bit vector with bit ``(x_i >> l) + i`` set for the ``i``-th
      offset ``x_i`` (Elias, 1974; Fano, 1971). 512 bits for 64 of 4096 instead of 768.
    """
    bits = _code_bits(plan)
    return min(bits, key=lambda code: bits[code])


def index_bits(plan: ChunkPlan) -> int:
    """Bits of one chunk's kept offsets on the wire (:func:`index_code`)."""
    return _code_bits(plan)[index_code(plan)]


def wire_order(idx: jax.Array, plan: ChunkPlan) -> jax.Array:
    """The kept offsets ``idx`` ``(chunks, k)`` in the order their values travel: ascending
    unless they travel as fields, else as given."""
    return idx if index_code(plan) == "fields" else jnp.sort(idx, axis=-1)


def _set_bits(bits: jax.Array, k: int) -> jax.Array:
    """Positions of the ``k`` set bits along the last axis of ``bits``, ascending (int32)."""
    n = bits.shape[-1]
    # The j-th set bit lands in slot j (its rank); clear bits go to a dropped slot k.
    on = bits.astype(jnp.int32)
    slot = jnp.where(on > 0, jnp.cumsum(on, axis=-1) - 1, k)
    flat = slot.reshape(-1, n) + (k + 1) * jnp.arange(slot.size // n)[:, None]
    out = (
        jnp.zeros((slot.size // n) * (k + 1), jnp.int32)
        .at[flat.reshape(-1)]
        .set(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), flat.shape).reshape(-1))
    )
    return out.reshape(*bits.shape[:-1], k + 1)[..., :k]


def to_bits(values: jax.Array, width: int) -> jax.Array:
    """``(K,)`` ints below ``2^width`` -> ``(K width,)`` uint8 bits, least significant first."""
    shifts = jnp.arange(width, dtype=jnp.int32)
    return ((values.astype(jnp.int32)[:, None] >> shifts) & 1).astype(jnp.uint8).reshape(-1)


def from_bits(bits: jax.Array, width: int) -> jax.Array:
    """Inverse of :func:`to_bits` over the last axis: ``(..., K)`` int32."""
    fields = bits.astype(jnp.int32).reshape(*bits.shape[:-1], -1, width)
    return jnp.sum(fields << jnp.arange(width, dtype=jnp.int32), axis=-1)


def encode_offsets(idx: jax.Array, plan: ChunkPlan) -> jax.Array:
    """The bits of kept offsets ``idx`` ``(chunks, k)`` (in :func:`wire_order`):
    ``(chunks index_bits,)`` uint8, chunk by chunk."""
    code, rows = index_code(plan), jnp.arange(plan.chunks)[:, None]
    if code == "mask":
        mask = jnp.zeros((plan.chunks, plan.length), jnp.uint8).at[rows, idx].set(1)
        return mask.reshape(-1)
    if code == "fields":
        return to_bits(idx.reshape(-1), offset_width(plan))
    low = _low_bits(plan)
    lows = to_bits((idx & (2**low - 1)).reshape(-1), low).reshape(plan.chunks, -1)
    high = (idx >> low) + jnp.arange(plan.k)
    upper = jnp.zeros((plan.chunks, plan.k + ((plan.length - 1) >> low) + 1), jnp.uint8)
    return jnp.concatenate([lows, upper.at[rows, high].set(1)], axis=1).reshape(-1)


def decode_offsets(bits: jax.Array, plan: ChunkPlan) -> jax.Array:
    """Inverse of :func:`encode_offsets` over the last axis: ``(..., chunks, k)`` int32."""
    lead, code = bits.shape[:-1], index_code(plan)
    per_chunk = bits.reshape(*lead, plan.chunks, -1)
    if code == "mask":
        return _set_bits(per_chunk, plan.k)
    if code == "fields":
        if offset_width(plan) == 0:  # one-element chunks: the offset is 0, nothing travels
            return jnp.zeros((*lead, plan.chunks, plan.k), jnp.int32)
        return from_bits(per_chunk, offset_width(plan))
    low = _low_bits(plan)
    lows = from_bits(per_chunk[..., : plan.k * low], low) if low else 0
    high = _set_bits(per_chunk[..., plan.k * low :], plan.k) - jnp.arange(plan.k)
    return (high << low) | lows


def pack_bits(bits: jax.Array) -> jax.Array:
    """``(B,)`` bits (0 or 1) -> ``(ceil(B / 8),)`` uint8, bit ``i`` in bit ``i % 8`` of byte
    ``i // 8`` (zeros fill the last byte)."""
    b = jnp.pad(bits.astype(jnp.uint8), (0, -bits.shape[0] % 8)).reshape(-1, 8)
    return jnp.sum(b << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, count: int) -> jax.Array:
    """Inverse of :func:`pack_bits` over the last axis: ``(..., count)`` uint8 bits."""
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & np.uint8(1)
    return bits.reshape(*packed.shape[:-1], -1)[..., :count]


def offset_bytes(plans: Sequence[ChunkPlan]) -> int:
    """Bytes of every kept offset of ``plans`` (the leaves that keep values, in order), their
    :func:`encode_offsets` bits one after another in :func:`pack_bits`."""
    return -(-sum(p.chunks * index_bits(p) for p in plans if p.kept) // 8)


def _offset_bits(
    packed: jax.Array, plans: Sequence[ChunkPlan]
) -> tuple[jax.Array, dict[int, tuple[int, int]]]:
    """The packed offsets as bits, and ``{leaf: (first bit, bits)}`` of each plan that keeps
    values among them."""
    spans, at = {}, 0
    for i, plan in enumerate(plans):
        if plan.kept:
            spans[i] = (at, plan.chunks * index_bits(plan))
            at += spans[i][1]
    return unpack_bits(packed[..., : -(-at // 8)], at), spans


def unpack_offsets(packed: jax.Array, plans: Sequence[ChunkPlan]) -> list[jax.Array]:
    """Inverse of :func:`offset_bytes`' packing over the last axis (``packed`` may run on):
    the ``(..., chunks, k)`` int32 offsets of each plan that keeps values, in order."""
    bits, spans = _offset_bits(packed, plans)
    return [decode_offsets(bits[..., a : a + width], plans[i]) for i, (a, width) in spans.items()]


def tile_groups(plans: Sequence[ChunkPlan], alone_from: int | None = None) -> list[list[int]]:
    """The plans that keep values grouped by tile and ``k`` (their chunks code and transform
    alike): lists of indices into ``plans``, in order of first appearance; a plan of at least
    ``alone_from`` chunks is a group by itself (stacking it would only copy it)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, plan in enumerate(plans):
        if plan.kept:
            alone = alone_from is not None and plan.chunks >= alone_from
            groups.setdefault((i,) if alone else (plan.h, plan.w, plan.k), []).append(i)
    return list(groups.values())


def stacked_plan(plans: Sequence[ChunkPlan]) -> ChunkPlan:
    """One plan for the chunks of ``plans`` (one :func:`tile_groups` group) stacked in order:
    an ``h x (w chunks)`` matrix of their tiles side by side."""
    h, w, k = plans[0].h, plans[0].w, plans[0].k
    return ChunkPlan(h, w * sum(p.chunks for p in plans), h, w, k)


def split_rows(members: Sequence[int], plans: Sequence[ChunkPlan]) -> list[slice]:
    """The rows of each of ``members`` in their :func:`stacked_plan`'s chunks."""
    ends = np.cumsum([plans[i].chunks for i in members]).tolist()
    return [slice(end - plans[i].chunks, end) for i, end in zip(members, ends, strict=True)]


def unpack_grouped_offsets(
    packed: jax.Array, plans: Sequence[ChunkPlan], groups: Sequence[Sequence[int]]
) -> list[jax.Array]:
    """:func:`unpack_offsets` decoded group by group (``groups`` from :func:`tile_groups`):
    each group's ``(..., chunks, k)`` int32 offsets, its members' chunks stacked in order."""
    bits, spans = _offset_bits(packed, plans)
    lead, out = bits.shape[:-1], []
    for members in groups:
        per_chunk = [
            bits[..., a : a + width].reshape(*lead, plans[i].chunks, -1)
            for i in members
            for a, width in [spans[i]]
        ]
        stacked = jnp.concatenate(per_chunk, axis=-2)
        plan = stacked_plan([plans[i] for i in members])
        out.append(decode_offsets(stacked.reshape(*lead, -1), plan))
    return out
