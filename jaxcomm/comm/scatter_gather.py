"""Compressed, coalesced reduce-scatter and all-gather of whole pytrees (DeepSpeed's
``reduce_scatter_coalesced``), in the rank-major layout of :mod:`jaxcomm.compressors.buckets`.

The reduce-scatters are calls of :func:`jaxcomm.comm.reduce.reduce_tree`; the all-gather (no
error feedback) runs its own bucket loop. State: ``jc.init_state(..., op="reduce_scatter")``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm._compat import bound_axis_size, ensure_varying
from jaxcomm.comm.axes import AxisName, axis_names
from jaxcomm.comm.reduce import EXACT, reduce_tree
from jaxcomm.comm.state import ScatterState, plan_tree
from jaxcomm.comm.two_level import gather_rows
from jaxcomm.compressors import Compressor
from jaxcomm.compressors.buckets import ceil_div, join_shards, map_buckets, unflatten_rank_major

PyTree = Any


def compressed_psum_scatter(
    tree: PyTree,
    state: ScatterState | None,
    *,
    axis_name: AxisName,
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
    out, new, *_ = reduce_tree(tree, state, axis_name, compressor, bucket_bytes, mean=False, op=op)
    return out, new


def compressed_pmean_scatter(
    tree: PyTree,
    state: ScatterState | None,
    *,
    axis_name: AxisName,
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
    out, new, *_ = reduce_tree(tree, state, axis_name, compressor, bucket_bytes, mean=True, op=op)
    return out, new


def compressed_all_gather(
    shards: PyTree,
    state: Any,
    *,
    axis_name: AxisName,
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
    names = axis_names(axis_name)
    axis_size = math.prod(bound_axis_size(a) for a in names)
    like_leaves, treedef, buckets = plan_tree(like, compressor, bucket_bytes)
    shard_leaves, shard_def = jax.tree_util.tree_flatten(shards)
    if shard_def != treedef:
        raise ValueError(
            f"jaxcomm: shards have structure {shard_def}, but like= has structure {treedef}"
        )

    def one_bucket(bucket):
        row = join_shards([shard_leaves[i] for i in bucket.leaf_ids], bucket, axis_size)
        if bucket.numel == 0:
            rows = jnp.zeros((axis_size, row.shape[0]), row.dtype)
        else:
            comp = EXACT if bucket.exact else compressor
            if len(names) > 1:  # the compressor across the slow axis, exact over the fast ones
                slow_size = bound_axis_size(names[0])
                mine = comp.all_gather(
                    ensure_varying(row, names[0]), axis_name=names[0], axis_size=slow_size
                )
                rows = gather_rows(mine, names[1:], slow_size, axis_size // slow_size)
            else:
                rows = comp.all_gather(
                    ensure_varying(row, axis_name), axis_name=axis_name, axis_size=axis_size
                )
        return unflatten_rank_major(rows, bucket, axis_size), None

    out, _ = map_buckets(one_bucket, buckets, len(like_leaves))
    return jax.tree_util.tree_unflatten(treedef, out), state


def shard_shapes(tree: PyTree, axis_size: int) -> PyTree:
    """Shapes of :func:`compressed_psum_scatter`'s output: ``(ceil(numel / n),)`` per leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((ceil_div(math.prod(x.shape), axis_size),), x.dtype),
        tree,
    )
