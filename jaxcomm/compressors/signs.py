"""The 1-bit wire: signs packed 8 per byte, with fp32 scales, and the arithmetic of each stage.

:class:`jaxcomm.OneBit` (one XLA program with its collectives) and DiLoCo's background sync
(device programs around host exchanges) both build the compressed all-reduce from these, so
the two give the same bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Bit k of a packed byte (most significant first) holds element 8*i + k: DeepSpeed's order.
_BIT_SHIFTS = np.arange(7, -1, -1, dtype=np.uint8)


def pack_signs(values: jax.Array) -> jax.Array:
    """Pack ``values >= 0`` 8 per byte, most significant bit first. ``len(values) % 8 == 0``."""
    return pack_sign_rows(values.reshape(-1, 8))


def scaled_sign_rows(packed: jax.Array, scale: jax.Array | float) -> jax.Array:
    """``scale * unpack_signs(packed)`` with the bits of byte ``m`` in row ``m``: ``(..., M)``
    bytes -> ``(..., M, 8)`` fp32 (``scale`` broadcast against ``packed``'s shape).

    A select of ``scale`` or ``-scale`` on the bit of each position, shifted down by its index
    along the new axis (an iota): XLA:CPU vectorises it whatever shape its consumer reads, at
    about a write's speed (masking with a constant array of the 8 bits instead ran several
    times slower once a consumer read it flat or as a leaf's shape).
    """
    shape = (*packed.shape, 8)
    position = lax.broadcasted_iota(jnp.uint8, shape, packed.ndim)
    bits = jnp.broadcast_to(packed[..., None], shape) >> (7 - position)
    scale = jnp.asarray(scale, jnp.float32)[..., None]
    return jnp.where((bits & 1) != 0, scale, -scale)


def scaled_signs(packed: jax.Array, scale: jax.Array | float) -> jax.Array:
    """``scale * unpack_signs(packed)``: :func:`scaled_sign_rows`, the last two axes merged."""
    out = scaled_sign_rows(packed, scale)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_sign_rows(rows: jax.Array) -> jax.Array:
    """``rows >= 0`` packed one byte per ``(..., M, 8)`` row, most significant bit first."""
    return jnp.sum((rows >= 0).astype(jnp.uint8) << _BIT_SHIFTS, axis=-1, dtype=jnp.uint8)


def unpack_signs(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_signs` as ``+1.0 / -1.0`` floats; the last axis grows eightfold."""
    return scaled_signs(packed, 1.0)


def scale_bytes(scale: jax.Array) -> jax.Array:
    """A fp32 scale bitcast to ``uint8[4]``, sent with the packed signs (one collective, not
    two)."""
    return lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)


def signs_and_scales(received: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of packed signs, each followed by its scale's bytes (:func:`scale_bytes`): the
    ``(n, M)`` signs and the ``n`` fp32 scales."""
    return received[:, :-4], lax.bitcast_convert_type(received[:, -4:], jnp.float32)


def sign(values: jax.Array) -> jax.Array:
    # sgn(0) = +1, as DeepSpeed's packing does: the reconstruction must use the packed bit.
    return jnp.where(values >= 0, 1.0, -1.0).astype(values.dtype)


def weighted_sign_sum(packed: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum_j weights[j] * unpack(packed[j])`` for packed ``(n, M)`` -> ``(M, 8)`` fp32 rows.

    For small ``n`` this unrolls into one elementwise fusion that reads each packed row once and
    never materializes ``n`` unpacked float rows (the naive broadcast is slower on CPU).
    """
    n = packed.shape[0]
    if n <= 16:
        total = scaled_sign_rows(packed[0], weights[0])
        for j in range(1, n):
            total = total + scaled_sign_rows(packed[j], weights[j])
        return total
    return jnp.einsum("j,jmk->mk", weights, scaled_sign_rows(packed, 1.0))


def l2_scale(values: jax.Array) -> jax.Array:
    """``||values||_2 / sqrt(size)``: the scale whose signs keep the buffer's L2 norm."""
    return jnp.sqrt(jnp.sum(jnp.square(values))) / math.sqrt(values.size)


def residual(values: jax.Array, scale: jax.Array) -> jax.Array:
    """What ``scale * sgn(values)`` leaves out: the new error feedback."""
    return values - scale * sign(values)


def worker_payload(buf: jax.Array, scale: jax.Array, axis_size: int) -> jax.Array:
    """``(n, Np/(8n) + 4)`` bytes: row ``j`` is chunk ``j``'s packed signs, then the scale."""
    packed = pack_signs(buf).reshape(axis_size, -1)
    tail = jnp.broadcast_to(scale_bytes(scale), (axis_size, 4))
    return jnp.concatenate([packed, tail], axis=1)


def server_chunk(old_rows: jax.Array, compensated: jax.Array, finite: jax.Array | None = None):
    """The server stage's reduced chunk and its scale: ``c = e_s + compensated`` (the weighted
    worker signs) in ``(M, 8)`` rows. With ``finite`` (were all worker scales finite?) false,
    ``c`` is ``e_s`` itself and the scale NaN: a non-finite input leaves a non-finite output."""
    c = old_rows + compensated
    if finite is not None:
        c = jnp.where(finite, c, old_rows)
    scale = l2_scale(c.reshape(-1))
    if finite is not None:
        scale = jnp.where(finite, scale, jnp.nan)
    return c, scale


def server_payload(rows: jax.Array, scale: jax.Array) -> jax.Array:
    """The reduced chunk's ``(M, 8)`` rows as ``M + 4`` bytes: packed signs, then the scale."""
    return jnp.concatenate([pack_sign_rows(rows), scale_bytes(scale)])


def decode_mean(signs: jax.Array, scales: jax.Array, numel: int) -> jax.Array:
    """The mean from every device's server chunk (``(n, M)`` signs, ``(n,)`` scales), cut to
    ``numel``."""
    return scaled_signs(signs, scales[:, None]).reshape(-1)[:numel]


def leaf_mean_squares(scales: jax.Array, chunk_numel: int, shapes) -> list[jax.Array]:
    """The mean of the squares of each leaf :func:`decode_leaves` gives, from the scales alone.

    Every decoded value is its chunk's scale or its negative, so a leaf's mean square is the
    chunks' squared scales weighted by how many of the leaf's elements each chunk holds
    (``chunk_numel`` elements per chunk, chunk ``j`` first at ``j * chunk_numel``): no pass
    over the leaf, where a reduction of the decoded leaf reads (on CPU: writes, then reads)
    all of it. Empty leaves give 0.
    """
    squares = jnp.square(scales.astype(jnp.float32))
    starts = np.arange(scales.shape[0]) * chunk_numel
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        counts = np.minimum(offset + size, starts + chunk_numel) - np.maximum(offset, starts)
        (held,) = np.nonzero(counts > 0)  # only the chunks the leaf is in: no 0 * inf
        weights = jnp.asarray(counts[held] / max(size, 1), jnp.float32)
        out.append(jnp.sum(weights * squares[held]) if size else jnp.zeros([], jnp.float32))
        offset += size
    return out


def decode_leaves(signs: jax.Array, scales: jax.Array, shapes) -> list[jax.Array]:
    """:func:`decode_mean` straight into leaves of ``shapes`` (concatenated in that order).

    A leaf whose offset and size are multiples of 8 is its rows of 8 (one packed byte each,
    see :func:`scaled_sign_rows`) reshaped: XLA computes it in that shape, vectorised, with no
    flat mean in between. Any other leaf is cut from the flat mean.
    """
    rows = scaled_sign_rows(signs, scales[:, None]).reshape(-1, 8)
    leaves, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        if offset % 8 == 0 and size % 8 == 0:
            piece = lax.slice_in_dim(rows, offset // 8, (offset + size) // 8)
        else:
            piece = lax.slice(rows.reshape(-1), (offset,), (offset + size,))
        leaves.append(piece.reshape(shape))
        offset += size
    return leaves
