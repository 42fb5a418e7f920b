"""Compressed, coalesced collectives over whole pytrees.

These run where a mesh axis is bound: inside ``jax.shard_map`` (``check_vma`` on or off), inside
``jax.pmap``, or inside an optax update called from either. Each call flattens the tree into
buckets (:mod:`jaxcomm.bucketing`), runs one collective chain per bucket with the chosen
compressor (:mod:`jaxcomm.compressors`) and restores every leaf's shape and dtype.

State. ``init_state`` builds one device's error-feedback state for its local tree. Every state
leaf is a rank >= 1 array private to its device, so a whole state passes through ``shard_map``
with ``in_specs``/``out_specs`` ``P(axis_name)`` (globally: the per-device states concatenated
along axis 0) or through ``pmap`` stacked on a leading axis. The state's bucket layout depends on
the tree, the axis size and ``bucket_bytes``; a state built for anything else is refused with an
error naming the mismatch.

Non-finite input. A NaN or Inf gradient makes the output non-finite (so loss scaling or
skip-step logic sees it), but it never reaches the error feedback: when a call's compressed
output or its new error state is not finite, every bucket state keeps its previous (finite)
value and the state's ``nonfinite`` counter (per device, int32 ``(1,)``) goes up by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import bucketing
from jaxcomm._compat import bound_axis_size, ensure_varying
from jaxcomm.bucketing import Bucket
from jaxcomm.compressors import Compressor, NoCompression

PyTree = Any
StateOp = Literal["all_reduce", "reduce_scatter"]


class ReduceState(NamedTuple):
    """Error feedback of :func:`compressed_psum` / :func:`compressed_pmean`, one per bucket.

    Attributes:
      buckets: one compressor state per bucket.
      nonfinite: int32 ``(1,)``: calls whose output or new state was not finite, so the
        bucket states were kept unchanged (``()`` when no bucket has error feedback).
    """

    buckets: tuple
    nonfinite: Any = ()


class ScatterState(NamedTuple):
    """Error feedback of :func:`compressed_psum_scatter`, one entry per bucket; ``nonfinite``
    as in :class:`ReduceState`."""

    buckets: tuple
    nonfinite: Any = ()


_STATE_TYPES = {"all_reduce": ReduceState, "reduce_scatter": ScatterState}


def _plan(tree: PyTree, compressor: Compressor, bucket_bytes: int | None):
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"jaxcomm: compressor must be a jaxcomm Compressor (e.g. jc.OneBit()), "
            f"got {compressor!r}"
        )
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return leaves, treedef, bucketing.plan_buckets(leaves, bucket_bytes, compressor.compute_dtype)


def _bucket_state(compressor: Compressor, bucket: Bucket, axis_size: int, op: StateOp):
    if bucket.exact or bucket.numel == 0:
        return ()
    return compressor.init_bucket_state(bucket, axis_size, op)


def _new_state(compressor: Compressor, buckets, axis_size: int, op: StateOp):
    states = tuple(_bucket_state(compressor, b, axis_size, op) for b in buckets)
    # The non-finite counter exists only where there is error feedback to protect, so exact
    # compressors keep a leafless state (and accept None).
    counter = jnp.zeros((1,), jnp.int32) if jax.tree_util.tree_leaves(states) else ()
    return _STATE_TYPES[op](states, counter)


def init_state(
    compressor: Compressor,
    tree: PyTree,
    *,
    axis_size: int,
    bucket_bytes: int | None = None,
    op: StateOp = "all_reduce",
) -> ReduceState | ScatterState:
    """One device's error-feedback state for reducing its local ``tree`` over ``axis_size`` devices.

    Args:
      compressor: the compressor the state is for.
      tree: the local tree (arrays or ``jax.ShapeDtypeStruct``s); only shapes and dtypes are read.
      axis_size: number of devices on the reduced axis.
      bucket_bytes: the bucket size the collective will be called with.
      op: ``"all_reduce"`` for ``compressed_psum``/``compressed_pmean``, ``"reduce_scatter"`` for
        ``compressed_psum_scatter``. (All-gathers carry no error feedback.)

    Returns:
      A ``ReduceState`` or ``ScatterState``; all leaves fp32 zeros of rank 1 (none for exact
      compressors).
    """
    if op not in _STATE_TYPES:
        raise ValueError(f"jaxcomm: op must be 'all_reduce' or 'reduce_scatter', got {op!r}")
    if not isinstance(axis_size, int | np.integer) or axis_size < 1:
        raise ValueError(f"jaxcomm: axis_size must be a positive int, got {axis_size!r}")
    _, _, buckets = _plan(tree, compressor, bucket_bytes)
    return _new_state(compressor, buckets, int(axis_size), op)


def _check_state(state, compressor, buckets, axis_name, axis_size, op: StateOp, bucket_bytes):
    """Refuse, at trace time, a state that was built for another tree, axis or bucket size."""
    state_type = _STATE_TYPES[op]
    expected = jax.eval_shape(lambda: _new_state(compressor, buckets, axis_size, op))
    if state is None and not jax.tree_util.tree_leaves(expected):
        return expected  # stateless (NoCompression, or only exact leaves): None is accepted
    other = {v: k for k, v in _STATE_TYPES.items()}
    if type(state) in other and type(state) is not state_type:
        raise ValueError(
            f"jaxcomm: this state was built for {other[type(state)]!r} collectives; build one with "
            f"jc.init_state(compressor, tree, axis_size=n, op={op!r})"
        )
    context = (
        f"(this call: {len(buckets)} bucket(s), axis {axis_name!r} of size {axis_size}, "
        f"bucket_bytes={bucket_bytes}, compressor {compressor!r}). Was the state built for another "
        "tree, axis size, bucket_bytes or compressor?"
    )
    got_struct = jax.tree_util.tree_structure(state)
    want_struct = jax.tree_util.tree_structure(expected)
    if got_struct != want_struct:
        raise ValueError(
            f"jaxcomm: state structure {got_struct} does not match the expected {want_struct} "
            + context
        )
    for path_got, want in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(expected), strict=True
    ):
        path, got = path_got
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            raise ValueError(
                f"jaxcomm: state leaf {jax.tree_util.keystr(path)} has per-device shape "
                f"{tuple(got.shape)} {np.dtype(got.dtype)}, expected {tuple(want.shape)} "
                f"{np.dtype(want.dtype)} " + context
            )
    return state


def _exact_dtype(dtype: np.dtype) -> np.dtype:
    # lax.psum sums bools as int32 counts; do the same explicitly so empty buckets agree.
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


def _exact_all_reduce(flat: jax.Array, axis_name: str, axis_size: int, mean: bool) -> jax.Array:
    flat = flat.astype(_exact_dtype(flat.dtype))
    if flat.shape[0]:
        flat = lax.psum(flat, axis_name)
    else:  # nothing to send; a fresh constant is typed replicated, like a psum result
        flat = jnp.zeros((0,), flat.dtype)
    return flat / axis_size if mean else flat


def _all_reduce(tree, state, *, axis_name, compressor, bucket_bytes, mean):
    axis_size = bound_axis_size(axis_name)
    leaves, treedef, buckets = _plan(tree, compressor, bucket_bytes)
    checked = _check_state(
        state, compressor, buckets, axis_name, axis_size, "all_reduce", bucket_bytes
    )
    out: list = [None] * len(leaves)
    new_states, outputs = [], []
    for bucket, bucket_state in zip(buckets, checked.buckets, strict=True):
        flat = bucketing.flatten_bucket(leaves, bucket)
        if bucket.exact:
            reduced = _exact_all_reduce(flat, axis_name, axis_size, mean)
            dtypes = [reduced.dtype] * len(bucket.leaf_ids)
        elif bucket.numel == 0:
            reduced, dtypes = jnp.zeros((0,), flat.dtype), None
        else:
            reduced, bucket_state = compressor.all_reduce_bucket(
                flat, bucket_state, bucket, axis_name=axis_name, axis_size=axis_size, mean=mean
            )
            dtypes = None
            outputs.extend(compressor.finite_probe(reduced, bucket_state))
        for i, leaf in zip(
            bucket.leaf_ids, bucketing.unflatten_bucket(reduced, bucket, dtypes), strict=True
        ):
            out[i] = leaf
        new_states.append(bucket_state)
    return jax.tree_util.tree_unflatten(treedef, out), _restate(state, new_states, outputs)


def _restate(state, new_states, outputs):
    """The new state, or the old one (counted in ``nonfinite``) if anything is not finite.

    ``outputs`` are the compressed buckets' results. Under normal propagation a non-finite
    input on any device makes the (replicated) all-reduce output non-finite everywhere, so all
    devices keep their states together; a device whose own new state is non-finite keeps its
    state even if the output happens to be finite (e.g. a NaN that top-k did not pick).
    """
    # A stateless call (state=None) returns None, so users can keep passing None.
    if state is None:
        return None
    new_states = tuple(new_states)
    if not jax.tree_util.tree_leaves(state.buckets):
        return type(state)(new_states, state.nonfinite)
    # ``outputs`` holds each compressed bucket's finite probe (Compressor.finite_probe): its
    # output and new state, or a few elements that decide it (OneBit), so the check does not
    # cost extra passes over buffers that are memory-bound to produce.
    checks = [jnp.all(jnp.isfinite(x)) for x in outputs]
    finite = jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_states, state.buckets)
    return type(state)(kept, state.nonfinite + jnp.where(finite, 0, 1).astype(jnp.int32))


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
    """
    return _all_reduce(
        tree,
        state,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        mean=False,
    )


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
    """
    return _all_reduce(
        tree,
        state,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        mean=True,
    )


def _reduce_scatter(tree, state, *, axis_name, compressor, bucket_bytes, mean):
    axis_size = bound_axis_size(axis_name)
    leaves, treedef, buckets = _plan(tree, compressor, bucket_bytes)
    checked = _check_state(
        state, compressor, buckets, axis_name, axis_size, "reduce_scatter", bucket_bytes
    )
    out: list = [None] * len(leaves)
    new_states, outputs = [], []
    for bucket, bucket_state in zip(buckets, checked.buckets, strict=True):
        rows = bucketing.flatten_bucket_rank_major(leaves, bucket, axis_size)
        dtypes = bucket.dtypes
        if bucket.exact:
            rows = rows.astype(_exact_dtype(rows.dtype))
            row = rows[0]
            if bucket.numel:
                row = lax.psum_scatter(ensure_varying(rows, axis_name), axis_name)
            row = row / axis_size if mean else row
            dtypes = [row.dtype] * len(bucket.leaf_ids)
        elif bucket.numel == 0:
            row = rows[0]
        else:
            row, bucket_state = compressor.reduce_scatter_bucket(
                rows, bucket_state, bucket, axis_name=axis_name, axis_size=axis_size, mean=mean
            )
            outputs.extend(compressor.finite_probe(row, bucket_state))
        for i, shard, dtype in zip(
            bucket.leaf_ids, bucketing.split_shard(row, bucket, axis_size), dtypes, strict=True
        ):
            out[i] = shard.astype(dtype)
        new_states.append(bucket_state)
    return jax.tree_util.tree_unflatten(treedef, out), _restate(state, new_states, outputs)


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
    """
    return _reduce_scatter(
        tree,
        state,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        mean=False,
    )


def compressed_pmean_scatter(
    tree: PyTree,
    state: ScatterState | None,
    *,
    axis_name: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ScatterState | None]:
    """Like :func:`compressed_psum_scatter` but the mean (DeepSpeed's coalesced reduce-scatter)."""
    return _reduce_scatter(
        tree,
        state,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        mean=True,
    )


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
    """
    axis_size = bound_axis_size(axis_name)
    like_leaves, treedef, buckets = _plan(like, compressor, bucket_bytes)
    shard_leaves, shard_def = jax.tree_util.tree_flatten(shards)
    if shard_def != treedef:
        raise ValueError(
            f"jaxcomm: shards have structure {shard_def}, but like= has structure {treedef}"
        )
    out: list = [None] * len(like_leaves)
    for bucket in buckets:
        row = bucketing.join_shards([shard_leaves[i] for i in bucket.leaf_ids], bucket, axis_size)
        if bucket.numel == 0:
            rows = jnp.zeros((axis_size, row.shape[0]), row.dtype)
        elif bucket.exact:
            rows = NoCompression().all_gather(row, axis_name=axis_name, axis_size=axis_size)
        else:
            rows = compressor.all_gather(
                ensure_varying(row, axis_name), axis_name=axis_name, axis_size=axis_size
            )
        for i, leaf in zip(
            bucket.leaf_ids, bucketing.unflatten_rank_major(rows, bucket, axis_size), strict=True
        ):
            out[i] = leaf
    return jax.tree_util.tree_unflatten(treedef, out), state


def shard_shapes(tree: PyTree, axis_size: int) -> PyTree:
    """Shapes of :func:`compressed_psum_scatter`'s output: ``(ceil(numel / n),)`` per leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((-(-int(np.prod(x.shape)) // axis_size),), x.dtype), tree
    )


__all__: Sequence[str] = (
    "ReduceState",
    "ScatterState",
    "init_state",
    "compressed_psum",
    "compressed_pmean",
    "compressed_psum_scatter",
    "compressed_pmean_scatter",
    "compressed_all_gather",
    "shard_shapes",
)
