"""Hierarchical reduction on a 2-D mesh, in the older spelling of the tuple axis.

``hierarchical_pmean(tree, state, inner_axis="local", outer_axis="node", compressor=c)`` is
``jc.compressed_pmean(tree, state, axis_name=("node", "local"), compressor=c)``: exact over the
fast (inner) axis, ``c`` only across the slow (outer) one, on each device's ``1/L`` share of
every bucket (:mod:`jaxcomm.comm.two_level`). New code passes the tuple of axes, slowest first,
to the collectives and the optimizers directly; these names stay for existing callers.

The state is one device's error feedback for its share (:func:`init_hierarchical_state`, the
same as ``jc.init_state(c, tree, axis_size=(outer_size, inner_size))``); it differs per device,
so it is sharded over both axes: ``jc.stack_per_device(state, S * L)`` passed with
``P(("node", "local"))``. A compressor that needs the leaves' shapes (``PowerSGD``) is refused:
the slow axis sees 1-D shares.
"""

from __future__ import annotations

from typing import Any

from jaxcomm.comm.all_reduce import compressed_pmean, compressed_psum
from jaxcomm.comm.state import ReduceState, init_state
from jaxcomm.compressors import Compressor

PyTree = Any


def init_hierarchical_state(
    compressor: Compressor,
    tree: PyTree,
    *,
    inner_size: int,
    outer_size: int,
    bucket_bytes: int | None = None,
) -> ReduceState:
    """One device's state for :func:`hierarchical_psum` / :func:`hierarchical_pmean`:
    ``jc.init_state(compressor, tree, axis_size=(outer_size, inner_size), ...)``.

    Args:
      compressor: the compressor of the slow (outer) axis.
      tree: the local tree (arrays or ``ShapeDtypeStruct``s).
      inner_size: devices on the fast axis (each keeps the error feedback of ``1/inner_size``
        of every bucket).
      outer_size: devices on the slow axis.
      bucket_bytes: as for the collectives.
    """
    return init_state(
        compressor, tree, axis_size=(outer_size, inner_size), bucket_bytes=bucket_bytes
    )

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
    return compressed_psum(
        tree,
        state,
        axis_name=(outer_axis, inner_axis),
        compressor=compressor,
        bucket_bytes=bucket_bytes,
    )


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
    of devices, giving a floating mean like ``lax.pmean``. A state
    from :func:`init_hierarchical_state` of a tree with integer leaves fits (their buckets
    carry no state).
    """
    return compressed_pmean(
        tree,
        state,
        axis_name=(outer_axis, inner_axis),
        compressor=compressor,
        bucket_bytes=bucket_bytes,
    )
