"""Hierarchical reduction on a 2-D mesh: compress only across the slow axis.

On a mesh such as ``("node", "local")`` the devices of one node talk over a fast link (NVLink,
shared memory) and nodes over a slow one (Ethernet). Compressing the fast hop costs fidelity for
nothing, so, as Horovod's hierarchical all-reduce and ZeRO++'s hierarchical partitioning do:

1. exact reduce-scatter over the fast axis (each local rank owns ``1/L`` of every leaf);
2. compressed all-reduce of that shard over the slow axis, with the shard's error feedback;
3. exact all-gather over the fast axis.

Only step 2 crosses the slow axis, carrying ``1/L`` of the tree in compressed form: per device
``2 (S-1)/S * |shard|_compressed`` instead of ``2 (S L - 1)/(S L) * |tree|_fp32`` for a flat
fp32 all-reduce over all ``S L`` devices. :func:`jaxcomm.wire_bytes_by_axes` reads the split from
the compiled HLO.

The state is one device's error feedback for its shard tree (:func:`init_hierarchical_state`);
it differs per local rank, so it is sharded over both axes: ``jc.stack_per_device(state, S * L)``
passed with ``P(("node", "local"))``. The shards are 1-D, so a compressor that needs matrices
(``PowerSGD``) sends them exactly: use it flat instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm._compat import bound_axis_size
from jaxcomm.comm.all_reduce import compressed_pmean, compressed_psum
from jaxcomm.comm.scatter_gather import (
    compressed_all_gather,
    compressed_pmean_scatter,
    compressed_psum_scatter,
    shard_shapes,
)
from jaxcomm.comm.state import ReduceState, init_state
from jaxcomm.compressors import Compressor, NoCompression

PyTree = Any


def init_hierarchical_state(
    compressor: Compressor,
    tree: PyTree,
    *,
    inner_size: int,
    outer_size: int,
    bucket_bytes: int | None = None,
) -> ReduceState:
    """One device's state for :func:`hierarchical_psum` / :func:`hierarchical_pmean`.

    Args:
      compressor: the compressor of the slow (outer) axis.
      tree: the local tree (arrays or ``ShapeDtypeStruct``s).
      inner_size: devices on the fast axis (the tree is cut into ``inner_size`` shards).
      outer_size: devices on the slow axis.
      bucket_bytes: as for the collectives.
    """
    # The slow axis sees the fast axis's shards; bool leaves arrive there as int32 counts.
    shards = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.int32) if s.dtype == jnp.bool_ else s,
        shard_shapes(tree, inner_size),
    )
    return init_state(compressor, shards, axis_size=outer_size, bucket_bytes=bucket_bytes)


def _hierarchical(tree, state, inner_axis, outer_axis, compressor, bucket_bytes, mean: bool):
    exact = NoCompression()
    leaves, treedef = jax.tree.flatten(tree)
    # Integer and bool leaves are summed exactly on both hops, as the flat collectives do (bool
    # as int32 counts); a mean divides their sum once it is complete (below). Floating leaves
    # take the mean per hop. The outer call sees the shards in the order (and the integer
    # dtypes) that init_hierarchical_state planned its buckets for.
    integer = [not jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
    scatter = compressed_pmean_scatter if mean else compressed_psum_scatter
    floats, _ = scatter(
        [x for x, i in zip(leaves, integer, strict=True) if not i],
        None, axis_name=inner_axis, compressor=exact, bucket_bytes=bucket_bytes,
    )  # fmt: skip
    ints, _ = compressed_psum_scatter(
        [x for x, i in zip(leaves, integer, strict=True) if i],
        None, axis_name=inner_axis, compressor=exact, bucket_bytes=bucket_bytes,
    )  # fmt: skip
    floats, ints = iter(floats), iter(ints)
    shards = [next(ints) if i else next(floats) for i in integer]
    reduce = compressed_pmean if mean else compressed_psum
    shards, state = reduce(
        shards, state, axis_name=outer_axis, compressor=compressor, bucket_bytes=bucket_bytes
    )
    # Exact means of integer leaves are floating (as lax.pmean): gather in the shards' dtypes.
    like = [jax.ShapeDtypeStruct(x.shape, s.dtype) for x, s in zip(leaves, shards, strict=True)]
    out, _ = compressed_all_gather(
        shards, None, axis_name=inner_axis, compressor=exact, like=like, bucket_bytes=bucket_bytes
    )
    if mean:  # the outer mean of the inner sums, divided by the inner axis size
        inner = bound_axis_size(inner_axis)
        out = [x / inner if i else x for x, i in zip(out, integer, strict=True)]
    return jax.tree.unflatten(treedef, out), state


def hierarchical_psum(
    tree: PyTree,
    state: ReduceState | None,
    *,
    inner_axis: str,
    outer_axis: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None]:
    """Sum over both axes: exact over ``inner_axis``, ``compressor`` over ``outer_axis``.

    Equal to ``lax.psum(tree, (outer_axis, inner_axis))`` up to the outer compression; the
    result is identical on every device. ``state`` comes from :func:`init_hierarchical_state`.

    Examples:
      2 nodes of 4 devices (nested ``jax.vmap`` stands in for a ``("node", "local")`` mesh);
      int8 across nodes, exact within a node:

      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> g = jnp.arange(2 * 4 * 8.0).reshape(2, 4, 8) / 64  # (node, local, elements)
      >>> def step(x):
      ...     out, _ = jc.hierarchical_psum(
      ...         x, None, inner_axis="local", outer_axis="node", compressor=jc.Quantize()
      ...     )
      ...     return out
      >>> total = jax.vmap(jax.vmap(step, axis_name="local"), axis_name="node")(g)
      >>> exact = g.sum((0, 1))  # what lax.psum over both axes gives
      >>> bool(jnp.abs(total[0, 0] - exact).max() < 0.02 * jnp.abs(exact).max())  # int8 rounding
      True
    """
    return _hierarchical(tree, state, inner_axis, outer_axis, compressor, bucket_bytes, mean=False)


def hierarchical_pmean(
    tree: PyTree,
    state: ReduceState | None,
    *,
    inner_axis: str,
    outer_axis: str,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None]:
    """Mean over both axes; see :func:`hierarchical_psum`.

    Integer and bool leaves are never compressed (as in :func:`jaxcomm.compressed_pmean`):
    they are summed exactly, as integers, over both axes and the sum is divided by the number
    of devices, giving a floating mean like ``lax.pmean`` (bit for bit when both axis sizes are
    powers of two; otherwise within one rounding, the division being done per axis). A state
    from :func:`init_hierarchical_state` of a tree with integer leaves fits (their buckets
    carry no state).
    """
    return _hierarchical(tree, state, inner_axis, outer_axis, compressor, bucket_bytes, mean=True)
