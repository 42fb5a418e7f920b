"""One update of DeMo (:func:`jaxcomm.optim.demo.scale_by_demo`) besides its state: the chunks'
DCT, the kept coefficients of each device's momentum (:func:`momentum_messages`), their
all-gather (:func:`exchange_messages`) and the sign of their mean (:func:`sign_directions`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying
from jaxcomm.comm.axes import AxisName, axis_names, split_levels
from jaxcomm.compressors.chunks import (
    ChunkPlan,
    chunk_plan,
    encode_offsets,
    from_chunks,
    offset_bytes,
    pack_bits,
    split_rows,
    stacked_plan,
    tile_groups,
    to_chunks,
    unpack_grouped_offsets,
    wire_order,
)

_HIGHEST = lax.Precision.HIGHEST  # the DCT in true fp32 (no TF32 / bf16 passes on accelerators)
# Leaves of fewer chunks are stacked with their tile's others (fewer, larger ops); larger
# ones go alone, where stacking would only add a copy of them.
_ALONE_FROM = 64


def dct_basis(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``D`` (``n x n``, fp32): ``C = D x``, ``x = D^T C``."""
    b, j = np.arange(n)[:, None], np.arange(n)[None, :]
    d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j + 1) * b / (2 * n))
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def demo_plan(shape: tuple[int, ...], chunk_size: int, top_k: int) -> ChunkPlan:
    """The chunks of a tensor (:func:`jaxcomm.compressors.chunks.chunk_plan`) with DeMo's
    ``k = min(top_k, h w)`` kept coefficients per chunk (the same for 2-D tiles and vectors)."""
    plan = chunk_plan(tuple(shape), chunk_size, top_k)
    return dataclasses.replace(plan, k=min(top_k, plan.length) if plan.size else 0)


def _dct(chunks: jax.Array, plan: ChunkPlan, inverse: bool = False) -> jax.Array:
    """``D_h T D_w^T`` of every tile ``T`` of ``chunks`` ``(chunks, h w)`` (``inverse``:
    ``D_h^T T D_w``); a vector's chunks (``h = 1``) along the chunk only."""
    t = chunks.reshape(-1, plan.h, plan.w)
    if plan.h > 1:
        bh = jnp.asarray(dct_basis(plan.h))
        t = jnp.einsum("ji,cjl->cil" if inverse else "ij,cjl->cil", bh, t, precision=_HIGHEST)
    if plan.w > 1:
        bw = jnp.asarray(dct_basis(plan.w))
        t = jnp.einsum("cil,lk->cik" if inverse else "cil,kl->cik", t, bw, precision=_HIGHEST)
    return t.reshape(chunks.shape)


def gather_messages(packed: jax.Array, axis_name: AxisName) -> jax.Array:
    """Every replica's message ``packed`` (``(bytes,)`` uint8), stacked ``(replicas, bytes)``
    and replicated.

    One axis: an all-gather over it. A tuple of axes, slowest first: a replica is a node (a
    group of the slow axis) whose devices hold the same message; device ``l`` of the ``L`` on
    the fast axes sends only its ``1/L`` piece across the slow axis and the node's devices then
    all-gather their pieces, so each device receives ``(S - 1)/L`` messages across the slow
    link instead of ``S - 1``.
    """
    slow, fast = split_levels(axis_name)
    if not fast:
        return all_gather_replicated(ensure_varying(packed, slow), slow)
    size = packed.shape[0]
    pieces = int(lax.axis_size(fast))
    width = -(-size // pieces)
    rows = jnp.pad(packed, (0, pieces * width - size)).reshape(pieces, width)
    mine = rows[lax.axis_index(fast)]
    across = all_gather_replicated(ensure_varying(mine, axis_names(axis_name)), slow)  # (S, c)
    nodes = all_gather_replicated(ensure_varying(across, fast), fast)  # (L, S, c)
    return nodes.transpose(1, 0, 2).reshape(across.shape[0], pieces * width)[:, :size]


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """How a step's leaves go through the DCT: each leaf's plan, the groups of leaves whose
    chunks are stacked (same tile and ``k``, :func:`jaxcomm.compressors.chunks.tile_groups`),
    each group's stacked plan and each member's rows in it."""

    plans: list[ChunkPlan]
    groups: list[list[int]]
    group_plans: list[ChunkPlan]
    group_rows: list[list[slice]]


def tile_layout(shapes, chunk_size: int, top_k: int) -> TileLayout:
    """The :class:`TileLayout` of leaves of ``shapes``."""
    plans = [demo_plan(tuple(s), chunk_size, top_k) for s in shapes]
    groups = tile_groups(plans, alone_from=_ALONE_FROM)
    return TileLayout(
        plans,
        groups,
        [stacked_plan([plans[i] for i in members]) for members in groups],
        [split_rows(members, plans) for members in groups],
    )


def momentum_messages(ms: list[jax.Array], layout: TileLayout, wire: np.dtype):
    """Steps 2-4 of ``jc.scale_by_demo`` for the flat momenta ``ms``: ``({leaf: (offset
    bits, kept values)}, the momenta less what they send)``; leaves with the same tile go
    through the DCT, top-k and coding as one stack of chunks.

    What stays is ``IDCT(C - sent)``: the coefficients less the values sent (zero where a
    kept value travels in fp32, its rounding where it travels narrower), transformed back
    once. In exact arithmetic that is ``m - IDCT(sent)``; it does not build the dense
    ``sent`` or read ``m`` again (the DCT is orthonormal: both differ from it by fp32
    rounding of the same order)."""
    plans = layout.plans
    messages, leaf_left = {}, {}
    groups = zip(layout.groups, layout.group_plans, layout.group_rows, strict=True)
    for members, plan, rows_of in groups:
        coeffs = _dct(jnp.concatenate([to_chunks(ms[i], plans[i]) for i in members]), plan)
        key = jnp.where(jnp.isfinite(coeffs), jnp.abs(coeffs), jnp.inf)
        idx = wire_order(lax.top_k(key, plan.k)[1], plan)
        taken = jnp.take_along_axis(coeffs, idx, axis=-1)
        # The kept values are read before the coefficients are overwritten in place (else
        # XLA copies them for the readers it cannot order).
        taken, coeffs = lax.optimization_barrier((taken, coeffs))
        kept = taken.astype(wire)
        rows = jnp.arange(plan.chunks)[:, None]
        # Distinct offsets per chunk: a set in place of the kept coefficients.
        left = coeffs.at[rows, idx].set(taken - kept.astype(jnp.float32), unique_indices=True)
        left = _dct(left, plan, inverse=True)
        bits = encode_offsets(idx, plan).reshape(plan.chunks, -1)
        for i, rows_i in zip(members, rows_of, strict=True):
            messages[i] = (bits[rows_i], kept[rows_i].reshape(-1))
            leaf_left[i] = left[rows_i]
    new_ms = [
        from_chunks(leaf_left[i], plans[i]) if i in leaf_left else m for i, m in enumerate(ms)
    ]
    return messages, new_ms


def exchange_messages(messages: dict, plans: list[ChunkPlan], axis_name: AxisName, wire):
    """Step 5 of ``jc.scale_by_demo``: one all-gather of ``[offset bits | values]`` (uint8),
    leaf by leaf. Returns every replica's message ``(replicas, bytes)``, the values in fp32
    ``(replicas, kept)`` and whether they are all finite (``None, None, True`` when nothing is
    kept)."""
    total = sum(p.kept for p in plans)
    if not total:
        return None, None, jnp.ones([], jnp.bool_)
    order = sorted(messages)
    packed = jnp.concatenate(
        [
            pack_bits(jnp.concatenate([messages[i][0].reshape(-1) for i in order])),
            lax.bitcast_convert_type(
                jnp.concatenate([messages[i][1] for i in order]), jnp.uint8
            ).reshape(-1),
        ]
    )
    parts = gather_messages(packed, axis_name)
    n = parts.shape[0]
    raw = parts[:, offset_bytes(plans) :].reshape(n, total, wire.itemsize)
    all_values = lax.bitcast_convert_type(raw, wire).astype(jnp.float32)
    return parts, all_values, jnp.isfinite(jnp.sum(all_values))


def sign_directions(parts, all_values, layout: TileLayout, grads: list[jax.Array]):
    """Step 6 of ``jc.scale_by_demo``: per leaf ``sign(IDCT(S))``, ``S`` the scatter-mean of
    the gathered values over the replicas that sent each coefficient (by tile group), shaped
    like ``grads`` (zeros for a leaf that keeps nothing)."""
    directions = [jnp.zeros_like(g) for g in grads]
    if parts is None:
        return directions
    plans = layout.plans
    replicas = parts.shape[0]
    group_offsets = unpack_grouped_offsets(parts, plans, layout.groups)
    starts = np.cumsum([0] + [p.kept for p in plans])
    groups = zip(layout.groups, layout.group_plans, layout.group_rows, group_offsets, strict=True)
    for members, plan, rows_of, off in groups:
        val = jnp.concatenate(
            [all_values[:, starts[i] : starts[i + 1]] for i in members], axis=1
        ).reshape(-1)
        flat = (jnp.arange(plan.chunks)[:, None] * plan.length + off).reshape(-1)
        size = plan.chunks * plan.length
        # Each value is divided by how many replicas sent its coefficient before the sum:
        # the count is a narrow integer array, read back only where values land, and no
        # dense division pass follows (the sum divided by the count, bit for bit, when the
        # count is a power of two; within rounding otherwise).
        count = jnp.zeros((size,), count_dtype(replicas)).at[flat].add(1)
        share = val / count[flat].astype(jnp.float32)
        mean = jnp.zeros((size,), jnp.float32).at[flat].add(share).reshape(plan.chunks, -1)
        u = _dct(mean, plan, inverse=True)
        for i, rows_i in zip(members, rows_of, strict=True):
            directions[i] = jnp.sign(from_chunks(u[rows_i], plans[i])).reshape(grads[i].shape)
    return directions


def count_dtype(replicas: int) -> np.dtype:
    """The narrowest unsigned integer that counts up to ``replicas`` senders."""
    for dtype in (np.uint8, np.uint16):
        if replicas <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint32)
