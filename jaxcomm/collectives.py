"""Compressed, coalesced collectives over whole pytrees.

These run where a mesh axis is bound: inside ``jax.shard_map`` (``check_vma`` on or off), inside
``jax.pmap`` or ``jax.vmap(axis_name=...)``, or inside an optax update called from either. Each
call plans the tree's buckets (:mod:`jaxcomm.layout`), runs :func:`jaxcomm.layout.map_buckets`
with one collective chain per bucket (the chosen compressor, :mod:`jaxcomm.compressors`; integer
and bool buckets exactly, through :class:`NoCompression`), turns the compressor's sum or mean
into the one asked for (here only), restores every leaf's shape and dtype, and passes the new
error feedback through the non-finite guard (:func:`jaxcomm.state.keep_finite`).

State: :func:`init_state` (:mod:`jaxcomm.state`, re-exported here) builds one device's state.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import layout
from jaxcomm._compat import bound_axis_size, ensure_varying
from jaxcomm.compressors import Compressor, NoCompression, mean_or_fallback
from jaxcomm.state import ReduceState as ReduceState
from jaxcomm.state import ScatterState as ScatterState
from jaxcomm.state import StateOp as StateOp
from jaxcomm.state import as_local_block, check_state, keep_finite, plan_tree
from jaxcomm.state import init_state as init_state

PyTree = Any

_EXACT = NoCompression()


def _exact_dtype(dtype: np.dtype) -> np.dtype:
    # lax.psum sums bools as int32 counts; do the same explicitly so empty buckets agree.
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


def _as_requested(out: jax.Array, compressor: Compressor, mean: bool, axis_size: int):
    """The compressor's sum or mean (``returns_mean``) as the one the caller asked for."""
    if mean == compressor.returns_mean:
        return out
    return out / axis_size if mean else out * axis_size


def _fallback_leaves(fallback: PyTree, leaves: list, treedef) -> list:
    """``fallback``'s leaves, checked against the tree's (structure and shapes)."""
    fallback_leaves, fallback_def = jax.tree_util.tree_flatten(fallback)
    if fallback_def != treedef:
        raise ValueError(
            f"jaxcomm: fallback must have the tree's structure {treedef}, got {fallback_def}"
        )
    for i, (f, x) in enumerate(zip(fallback_leaves, leaves, strict=True)):
        if np.shape(f) != np.shape(x):
            raise ValueError(
                f"jaxcomm: fallback leaf {i} has shape {np.shape(f)}, the tree's {np.shape(x)}"
            )
    return fallback_leaves


def _reduce(
    tree, state, axis_name, compressor, bucket_bytes, *, mean: bool, op: StateOp, fallback=None
):
    """All-reduce (concatenated layout) or reduce-scatter (rank-major rows) of every bucket.

    Returns the reduced tree, the new state and, with a ``fallback`` tree (all-reduce means
    only), the floating buckets' flags (whether each mean was finite, else it is fallback's).
    """
    axis_size = bound_axis_size(axis_name)
    leaves, treedef, buckets = plan_tree(tree, compressor, bucket_bytes)
    fallback_leaves = None if fallback is None else _fallback_leaves(fallback, leaves, treedef)
    scatter = op == "reduce_scatter"
    local, restore = as_local_block(state, compressor, buckets, axis_size, op)
    checked = check_state(local, compressor, buckets, axis_name, axis_size, op, bucket_bytes)
    # A compressor that computes in the (1, *local) block layout gets the blocks themselves, so
    # that XLA updates the donated buffers in place (a squeeze and its inverse around the update
    # cost a fresh buffer and a copy per state leaf on XLA:CPU).
    blocks = local is not state and not scatter and compressor.takes_state_blocks
    bucket_states = state.buckets if blocks else checked.buckets
    finites, mean_finites = [], []

    def one_bucket(bucket, bucket_state):
        comp = _EXACT if bucket.exact else compressor
        if scatter and (comp.scatter_layout == "rank_major" or bucket.numel == 0):
            buf = layout.flatten_bucket_rank_major(leaves, bucket, axis_size)
        else:
            buf = layout.flatten_bucket(leaves, bucket)
        if bucket.exact:
            buf = buf.astype(_exact_dtype(buf.dtype))
        guarded = not (bucket.exact or state is None or not jax.tree_util.tree_leaves(bucket_state))
        if bucket.numel == 0:
            # Nothing to send. All-reduce: a fresh constant, typed replicated like a psum result;
            # reduce-scatter: this device's (empty) row.
            out = buf[0] if scatter else jnp.zeros((0,), buf.dtype)
            out = _as_requested(out, comp, mean, axis_size)
        elif fallback_leaves is not None and not bucket.exact:
            kept = [fallback_leaves[i].astype(buf.dtype) for i in bucket.leaf_ids]
            if guarded:
                parts, bucket_state, finite = comp.guarded_all_reduce_leaves(
                    buf, bucket_state, bucket, kept, axis_name=axis_name, axis_size=axis_size
                )
                finites.append(finite)
            else:
                out, bucket_state = comp.all_reduce_bucket(
                    buf, bucket_state, bucket, axis_name=axis_name, axis_size=axis_size
                )
                parts, finite = mean_or_fallback(
                    _as_requested(out, comp, True, axis_size), bucket, kept
                )
            mean_finites.append(finite)
            return [p.astype(d) for p, d in zip(parts, bucket.dtypes, strict=True)], bucket_state
        else:
            if not guarded:
                run = comp.reduce_scatter_bucket if scatter else comp.all_reduce_bucket
                out, bucket_state = run(
                    buf, bucket_state, bucket, axis_name=axis_name, axis_size=axis_size
                )
            else:  # each bucket guards its own state (no flag shared by all buckets)
                run = (
                    comp.guarded_reduce_scatter_bucket
                    if scatter
                    else comp.guarded_all_reduce_bucket
                )
                out, bucket_state, finite = run(
                    buf, bucket_state, bucket, axis_name=axis_name, axis_size=axis_size
                )
                finites.append(finite)
            out = _as_requested(out, comp, mean, axis_size)
        dtypes = [out.dtype] * len(bucket.leaf_ids) if bucket.exact else bucket.dtypes
        if scatter:
            pieces = layout.split_shard(out, bucket, axis_size)
            return [p.astype(d) for p, d in zip(pieces, dtypes, strict=True)], bucket_state
        return layout.unflatten_bucket(out, bucket, dtypes), bucket_state

    out, new_states = layout.map_buckets(one_bucket, buckets, len(leaves), bucket_states)
    kept = (
        keep_finite(state, new_states, finites)
        if blocks
        else restore(keep_finite(local, new_states, finites))
    )
    return jax.tree_util.tree_unflatten(treedef, out), kept, mean_finites


def compressed_psum(
    tree: PyTree,
    state: ReduceState | None,
    *,
    axis_name: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None]:
    """Sum of ``tree`` over ``axis_name``, compressed, one collective chain per bucket.

    Floating leaves are reduced by ``compressor`` (in its compute dtype, returned in their own);
    integer and bool leaves are summed exactly (bool as int32 counts, as ``lax.psum``).
    The result is identical on every device and typed as replicated under ``check_vma``.

    Args:
      tree: this device's local pytree of arrays.
      state: from :func:`init_state` (``None`` is accepted for stateless compressors).
      axis_name: a bound mesh or pmap axis.
      compressor: e.g. ``jc.OneBit()`` or ``jc.NoCompression()``.
      bucket_bytes: ``None`` for one bucket per dtype, else about this many bytes per bucket.

    Returns:
      ``(summed tree, new state)``.

    Examples:
      Four devices' gradients (``jax.vmap`` with an axis name stands in for ``shard_map`` or
      ``pmap`` here); exact, one fused all-reduce per dtype:

      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> grads = {"w": jnp.arange(8.0).reshape(4, 2), "count": jnp.ones((4,), jnp.int32)}
      >>> def step(g):
      ...     return jc.compressed_psum(g, None, axis_name="i", compressor=jc.NoCompression())
      >>> total, _ = jax.vmap(step, axis_name="i")(grads)
      >>> total["w"][0].tolist(), int(total["count"][0])
      ([12.0, 16.0], 4)
    """
    out, new, _ = _reduce(
        tree, state, axis_name, compressor, bucket_bytes, mean=False, op="all_reduce"
    )
    return out, new


def compressed_pmean(
    tree: PyTree,
    state: ReduceState | None,
    *,
    axis_name: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None]:
    """Mean of ``tree`` over ``axis_name``; see :func:`compressed_psum`.

    Integer and bool leaves give a floating mean, exactly as ``lax.pmean``.

    Jitting it yourself with the state donated: put the state first, in the arguments (before
    donated gradients) and in the outputs (before the mean). Donated buffers are paired with
    outputs of their shape in order, so a mean returned first can take an error buffer's place;
    XLA then copies that buffer to keep the old residual a non-finite step needs (measured: a
    64 MiB copy, +7-12% on a OneBit op). ``jc.make_train_step`` does this for you.

    Examples:
      1-bit compression with error feedback: one state per device (``jc.init_state``), carried
      from step to step. Each element is sent as its sign, so the first mean is coarse; what it
      misses stays in the error feedback and is sent at the next steps:

      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> g = jnp.array([1.0, -2.0, 3.0, 0.5]) * jnp.arange(1.0, 5.0)[:, None]  # 4 devices
      >>> state = jc.init_state(jc.OneBit(), g[0], axis_size=4)
      >>> states = jax.tree.map(lambda s: jnp.stack([s] * 4), state)  # vmap: stacked per device
      >>> def step(x, s):
      ...     return jc.compressed_pmean(x, s, axis_name="i", compressor=jc.OneBit())
      >>> mean, states = jax.vmap(step, axis_name="i")(g, states)
      >>> bool((jnp.sign(mean[0]) == jnp.sign(g.mean(0))).all())
      True
      >>> states.buckets[0].worker_error.shape  # (devices, padded bucket)
      (4, 32)
    """
    out, new, _ = _reduce(
        tree, state, axis_name, compressor, bucket_bytes, mean=True, op="all_reduce"
    )
    return out, new


def compressed_pmean_or_fallback(
    tree: PyTree,
    state: ReduceState | None,
    fallback: PyTree,
    *,
    axis_name: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None, jax.Array]:
    """:func:`compressed_pmean`, with ``fallback``'s leaves for a bucket whose mean is not finite.

    For a caller that keeps a value on a non-finite step and whose mean *is* the new value (1-bit
    Adam in the step's space: the mean of the local momenta is the new momentum, and a skipped
    step keeps the old one). Selecting afterwards, ``where(finite, mean, old)``, reads the mean
    and the old value and writes the new one: a pass as large as the tree. Here the choice is
    made where the mean is produced: OneBit decodes it straight into the leaves inside its
    guard's conditional, whose other branch passes ``fallback`` through (no pass, no copy);
    other compressors select leaf by leaf.

    Buckets decide separately (their chains stay independent): with several buckets, one whose
    mean is finite returns it while another returns ``fallback``'s leaves. ``finite`` says
    whether every bucket's mean was finite; a caller that keeps the whole tree on a non-finite
    step selects on it (or uses one bucket, ``bucket_bytes=None``). The state is guarded as by
    :func:`compressed_pmean`. Integer and bool leaves are reduced exactly, never replaced.

    Args:
      tree, state, axis_name, compressor, bucket_bytes: as :func:`compressed_pmean`.
      fallback: a tree with ``tree``'s structure and leaf shapes (e.g. the previous momentum),
        cast to each leaf's dtype.

    Returns:
      ``(mean or fallback, new state, finite)``; ``finite`` is a bool scalar, replicated as the
      mean is.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> old = {"m": jnp.full((4, 2), 7.0)}  # 4 devices (vmap stands in for shard_map)
      >>> g = {"m": jnp.arange(8.0).reshape(4, 2).at[1, 0].set(jnp.nan)}
      >>> def step(x, keep):
      ...     return jc.compressed_pmean_or_fallback(
      ...         x, None, keep, axis_name="i", compressor=jc.NoCompression()
      ...     )
      >>> mean, _, finite = jax.vmap(step, axis_name="i")(g, old)
      >>> mean["m"][0].tolist(), bool(finite[0])
      ([7.0, 7.0], False)
    """
    out, new, flags = _reduce(
        tree,
        state,
        axis_name,
        compressor,
        bucket_bytes,
        mean=True,
        op="all_reduce",
        fallback=fallback,
    )
    finite = jnp.bool_(True)
    for flag in flags:
        finite = finite & flag
    return out, new, finite


def compressed_psum_scatter(
    tree: PyTree,
    state: ScatterState | None,
    *,
    axis_name: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ScatterState | None]:
    """Reduce-scatter of a whole tree, coalesced (DeepSpeed's ``reduce_scatter_coalesced``).

    Each leaf is flattened and zero-padded to ``n * c`` with ``c = ceil(numel / n)``; device ``r``
    receives the sum of ``[r*c, (r+1)*c)`` of that leaf from every device, as a 1-D ``(c,)`` array
    in the leaf's dtype. All leaves of a bucket travel in one collective chain.

    The state comes from ``init_state(..., op="reduce_scatter")``. Invert with
    :func:`compressed_all_gather` (``like=tree``).

    Examples:
      A leaf of 6 elements over 4 devices: each device gets ``ceil(6 / 4) = 2`` of the sum (the
      last device's slice is padding):

      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> def step(g):
      ...     exact = jc.NoCompression()
      ...     return jc.compressed_psum_scatter(g, None, axis_name="i", compressor=exact)
      >>> shards, _ = jax.vmap(step, axis_name="i")({"w": jnp.ones((4, 6))})
      >>> shards["w"].tolist()
      [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0], [0.0, 0.0]]
    """
    op = "reduce_scatter"
    out, new, _ = _reduce(tree, state, axis_name, compressor, bucket_bytes, mean=False, op=op)
    return out, new


def compressed_pmean_scatter(
    tree: PyTree,
    state: ScatterState | None,
    *,
    axis_name: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ScatterState | None]:
    """Like :func:`compressed_psum_scatter` but the mean (DeepSpeed's coalesced reduce-scatter).

    Examples:
      Blockwise int8 (``jc.Quantize``, ZeRO++ qgZ): each device receives its slice of the mean:

      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> g = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)  # 4 devices, 8 elements each
      >>> def step(x):
      ...     return jc.compressed_pmean_scatter(x, None, axis_name="i", compressor=jc.Quantize())
      >>> shards, _ = jax.vmap(step, axis_name="i")(g)
      >>> shards.shape, bool(jnp.abs(shards.reshape(-1) - g.mean(0)).max() < 1e-2)
      ((4, 2), True)
    """
    op = "reduce_scatter"
    out, new, _ = _reduce(tree, state, axis_name, compressor, bucket_bytes, mean=True, op=op)
    return out, new


def compressed_all_gather(
    shards: PyTree,
    state: Any,
    *,
    axis_name: str,
    compressor: Compressor,
    like: PyTree,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, Any]:
    """Inverse of :func:`compressed_psum_scatter`: every device's slices back into full leaves.

    ``shards`` has the structure of ``like`` with each leaf replaced by this device's ``(c,)``
    slice (``c = ceil(numel / n)``); ``like`` (arrays or ``ShapeDtypeStruct``s) gives shapes and
    output dtypes. One collective per bucket. Gathers carry no error feedback, so ``state`` is
    returned unchanged. ``OneBit`` gathers exactly: signs of weights are not weights.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> like = {"w": jax.ShapeDtypeStruct((6,), jnp.float32)}
      >>> shards = {"w": jnp.arange(8.0).reshape(4, 2)}  # device r holds [2r, 2r + 2)
      >>> def gather(s):
      ...     return jc.compressed_all_gather(
      ...         s, None, axis_name="i", compressor=jc.NoCompression(), like=like
      ...     )
      >>> full, _ = jax.vmap(gather, axis_name="i")(shards)
      >>> full["w"][0].tolist()  # the padding (6.0, 7.0) is dropped
      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    axis_size = bound_axis_size(axis_name)
    like_leaves, treedef, buckets = plan_tree(like, compressor, bucket_bytes)
    shard_leaves, shard_def = jax.tree_util.tree_flatten(shards)
    if shard_def != treedef:
        raise ValueError(
            f"jaxcomm: shards have structure {shard_def}, but like= has structure {treedef}"
        )

    def one_bucket(bucket):
        row = layout.join_shards([shard_leaves[i] for i in bucket.leaf_ids], bucket, axis_size)
        if bucket.numel == 0:
            rows = jnp.zeros((axis_size, row.shape[0]), row.dtype)
        else:
            comp = _EXACT if bucket.exact else compressor
            rows = comp.all_gather(
                ensure_varying(row, axis_name), axis_name=axis_name, axis_size=axis_size
            )
        return layout.unflatten_rank_major(rows, bucket, axis_size), None

    out, _ = layout.map_buckets(one_bucket, buckets, len(like_leaves))
    return jax.tree_util.tree_unflatten(treedef, out), state


def shard_shapes(tree: PyTree, axis_size: int) -> PyTree:
    """Shapes of :func:`compressed_psum_scatter`'s output: ``(ceil(numel / n),)`` per leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((layout.ceil_div(math.prod(x.shape), axis_size),), x.dtype),
        tree,
    )
