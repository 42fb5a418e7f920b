"""The bucket reduction every compressed collective runs: plan, check, one chain per bucket.

:func:`reduce_tree` plans the tree's buckets (:mod:`jaxcomm.compressors.buckets`), checks the
state (:func:`jaxcomm.comm.state.check_state`), runs
:func:`jaxcomm.compressors.buckets.map_buckets` with one collective chain per bucket (the
chosen compressor, :mod:`jaxcomm.compressors`; integer and bool buckets exactly, through
:data:`EXACT`), turns the compressor's sum or mean into the one asked for (here only),
restores every leaf's shape and dtype, and passes the new error feedback through the
non-finite guard (:func:`jaxcomm.comm.state.keep_finite`). The all-reduces
(:mod:`jaxcomm.comm.all_reduce`) and reduce-scatters (:mod:`jaxcomm.comm.scatter_gather`) are
thin calls of it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._compat import bound_axis_size
from jaxcomm.comm.axes import axis_names
from jaxcomm.comm.state import StateOp, as_local_block, check_state, keep_finite, plan_tree
from jaxcomm.comm.two_level import gather_shares, scatter_rows, scatter_share, share_bucket
from jaxcomm.compressors import Compressor, NoCompression, mean_leaves, mean_or_fallback
from jaxcomm.compressors.buckets import (
    flatten_bucket,
    flatten_bucket_rank_major,
    map_buckets,
    split_concatenated,
    split_shard,
    unflatten_bucket,
)

PyTree = Any

#: The exact compressor of integer and bool buckets (and of every bucket's empty case).
EXACT = NoCompression()


def _exact_dtype(dtype: np.dtype) -> np.dtype:
    # lax.psum sums bools as int32 counts; do the same explicitly so empty buckets agree.
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


def _as_requested(out: jax.Array, compressor: Compressor, mean: bool, axis_size: int):
    """The compressor's sum or mean (``returns_mean``) as the one the caller asked for."""
    if mean == compressor.returns_mean:
        return out
    return out / axis_size if mean else out * axis_size


def _leaves_as_requested(out, bucket, compressor: Compressor, mean: bool, axis_size: int):
    """A bucket's flat output as its leaves, each scaled as requested after the split: a scale
    over the whole bucket before it would be one pass per leaf over the whole bucket in XLA's
    accounting (each leaf's fusion reads the scaled buffer it slices)."""
    return [
        _as_requested(piece, compressor, mean, axis_size).reshape(shape).astype(dtype)
        for piece, shape, dtype in zip(
            split_concatenated(out, bucket), bucket.shapes, bucket.dtypes, strict=True
        )
    ]


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


def _check_two_level(compressor: Compressor, scatter: bool) -> None:
    """Refuse a compressor that cannot run on the two-level transport's 1-D shares."""
    if not compressor.splits_into_shares:
        raise ValueError(
            f"jaxcomm: {type(compressor).__name__} compresses each leaf in its own shape, but over "
            "a tuple of axes the slow axis sees 1-D shares of the buckets: use one axis, or "
            "another compressor"
        )
    if scatter and compressor.scatter_layout != "rank_major":
        raise ValueError(
            f"jaxcomm: {type(compressor).__name__} reduce-scatters whole buckets, so it cannot "
            "reduce-scatter over a tuple of axes: use one axis, or another compressor"
        )


class Reduced(NamedTuple):
    """What :func:`reduce_tree` returns.

    Attributes:
      tree: the reduced tree.
      state: the new state.
      flags: the floating buckets' finite flags (see :func:`reduce_tree`).
      fresh: with a fallback, the mean as computed, before the fallback; else ``None``.
      packed: with a fallback, each bucket's mean as sent
        (:meth:`~jaxcomm.compressors.Compressor.init_packed_mean`'s form) where every bucket
        has one, else ``None``.
    """

    tree: PyTree
    state: Any
    flags: list
    fresh: PyTree | None
    packed: tuple | None


def reduce_tree(
    tree, state, axis_name, compressor, bucket_bytes, *, mean: bool, op: StateOp, fallback=None
) -> Reduced:
    """All-reduce (concatenated layout) or reduce-scatter (rank-major rows) of every bucket.

    Returns the reduced tree, the new state, the floating buckets' flags, the mean as computed
    and the packed means (:class:`Reduced`). With a ``fallback`` tree (all-reduce means only):
    the flags say whether each bucket's mean was finite, else the reduced tree holds
    fallback's leaves, and the mean as computed is the tree before that fallback (not finite
    where a mean is not); without one, no flags and ``None``.
    """
    names = axis_names(axis_name)
    axis_name = names[0] if len(names) == 1 else names
    sizes = tuple(bound_axis_size(a) for a in names)
    axis_size = math.prod(sizes)  # all devices: the exact buckets' reductions run over them
    state_sizes = sizes if len(names) > 1 else axis_size
    leaves, treedef, buckets = plan_tree(tree, compressor, bucket_bytes)
    fallback_leaves = None if fallback is None else _fallback_leaves(fallback, leaves, treedef)
    scatter = op == "reduce_scatter"
    if len(names) > 1:
        _check_two_level(compressor, scatter)
    local, restore = as_local_block(state, compressor, buckets, state_sizes, op)
    checked = check_state(local, compressor, buckets, axis_name, state_sizes, op, bucket_bytes)
    # A compressor that computes in the (1, *local) block layout gets the blocks themselves, so
    # that XLA updates the donated buffers in place (a squeeze and its inverse around the update
    # cost a fresh buffer and a copy per state leaf on XLA:CPU).
    blocks = (
        local is not state and not scatter and compressor._takes_state_blocks and len(names) == 1
    )
    bucket_states = state.buckets if blocks else checked.buckets
    finites, mean_finites = [], []
    fresh_leaves: dict[int, jax.Array] = {}  # the means before the fallback, by leaf
    packed: list = []  # each bucket's mean as sent, with a fallback

    def keep_fresh(bucket, means):
        for i, x, d in zip(bucket.leaf_ids, means, bucket.dtypes, strict=True):
            fresh_leaves[i] = x.astype(d)

    def one_bucket(bucket, bucket_state):
        if len(names) > 1 and not bucket.exact and bucket.numel:
            return two_level_bucket(bucket, bucket_state)
        comp = EXACT if bucket.exact else compressor
        if scatter and (comp.scatter_layout == "rank_major" or bucket.numel == 0):
            buf = flatten_bucket_rank_major(leaves, bucket, axis_size)
        else:
            buf = flatten_bucket(leaves, bucket)
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
                parts, bucket_state, finite, fresh, sent = comp.guarded_all_reduce_leaves(
                    buf, bucket_state, bucket, kept, axis_name=axis_name, axis_size=axis_size
                )
                finites.append(finite)
                packed.append(sent)
            else:
                out, bucket_state = comp.all_reduce_bucket(
                    buf, bucket_state, bucket, axis_name=axis_name, axis_size=axis_size
                )
                out = _as_requested(out, comp, True, axis_size)
                parts, finite = mean_or_fallback(out, bucket, kept)
                fresh = mean_leaves(out, bucket)
                packed.append(None)
            mean_finites.append(finite)
            keep_fresh(bucket, fresh)
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
            if not (scatter or bucket.exact):
                return _leaves_as_requested(out, bucket, comp, mean, axis_size), bucket_state
            out = _as_requested(out, comp, mean, axis_size)
        dtypes = [out.dtype] * len(bucket.leaf_ids) if bucket.exact else bucket.dtypes
        if scatter:
            pieces = split_shard(out, bucket, axis_size)
            return [p.astype(d) for p, d in zip(pieces, dtypes, strict=True)], bucket_state
        return unflatten_bucket(out, bucket, dtypes), bucket_state

    def two_level_bucket(bucket, bucket_state):
        # Exact over the fast axes, the compressor across the slow one on this device's share
        # (jaxcomm.comm.two_level); the guard and the fallback as on one axis.
        slow, fast = names[0], names[1:]
        slow_size, fast_size = sizes[0], axis_size // sizes[0]
        inner = share_bucket(bucket, slow_size, fast_size, op)
        guarded = not (state is None or not jax.tree_util.tree_leaves(bucket_state))
        kw = dict(axis_name=slow, axis_size=slow_size)
        if scatter:
            rows = scatter_rows(
                flatten_bucket_rank_major(leaves, bucket, axis_size), fast, slow_size, fast_size
            )
            buf = rows / fast_size if mean else rows
            run = compressor.guarded_reduce_scatter_bucket if guarded else None
            run = run or compressor.reduce_scatter_bucket
        else:
            buf = scatter_share(flatten_bucket(leaves, bucket), fast, fast_size, mean)
            run = compressor.guarded_all_reduce_bucket if guarded else None
            run = run or compressor.all_reduce_bucket
        out, bucket_state, *finite = run(buf, bucket_state, inner, **kw)
        finites.extend(finite)
        out = _as_requested(out, compressor, mean, slow_size)
        if scatter:
            pieces = split_shard(out, bucket, axis_size)
            return [p.astype(d) for p, d in zip(pieces, bucket.dtypes, strict=True)], bucket_state
        full = gather_shares(out, fast, bucket.numel)
        if fallback_leaves is None:
            return unflatten_bucket(full, bucket), bucket_state
        kept = [fallback_leaves[i].astype(full.dtype) for i in bucket.leaf_ids]
        parts, finite_mean = mean_or_fallback(full, bucket, kept)
        mean_finites.append(finite_mean)
        packed.append(None)
        keep_fresh(bucket, mean_leaves(full, bucket))
        return [p.astype(d) for p, d in zip(parts, bucket.dtypes, strict=True)], bucket_state

    out, new_states = map_buckets(one_bucket, buckets, len(leaves), bucket_states)
    kept = (
        keep_finite(state, new_states, finites)
        if blocks
        else restore(keep_finite(local, new_states, finites))
    )
    fresh = None
    if fallback_leaves is not None:  # exact and empty buckets: their result, never replaced
        fresh_out = [fresh_leaves.get(i, x) for i, x in enumerate(out)]
        fresh = jax.tree_util.tree_unflatten(treedef, fresh_out)
    whole = len(packed) == len(buckets) and all(p is not None for p in packed)
    out_tree = jax.tree_util.tree_unflatten(treedef, out)
    return Reduced(out_tree, kept, mean_finites, fresh, tuple(packed) if whole else None)
