"""Compressed, coalesced all-reduces of whole pytrees: sum, mean, mean with a fallback.

These run where a mesh axis is bound: inside ``jax.shard_map`` (``check_vma`` on or off), inside
``jax.pmap`` or ``jax.vmap(axis_name=...)``, or inside an optax update called from either. Each
is one call of :func:`jaxcomm.comm.reduce.reduce_tree` (the buckets, the compressor's chain per
bucket, the non-finite guard). State: :func:`jaxcomm.init_state` (:mod:`jaxcomm.comm.state`).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcomm.comm.axes import AxisName
from jaxcomm.comm.reduce import reduce_tree
from jaxcomm.comm.state import ReduceState
from jaxcomm.compressors import Compressor
from jaxcomm.guard import all_of

PyTree = Any


def compressed_psum(
    tree: PyTree,
    state: ReduceState | None,
    *,
    axis_name: AxisName,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None]:
    """Sum of ``tree`` over ``axis_name``, compressed, one collective chain per bucket.

    Floating leaves are reduced by ``compressor`` (in its compute dtype, returned in their own);
    integer and bool leaves are summed exactly (bool as int32 counts, as ``lax.psum``).
    The result is identical on every device and typed as replicated under ``check_vma``.

    Args:
      tree: this device's local pytree of arrays.
      state: from :func:`jaxcomm.init_state` (``None`` is accepted for stateless compressors).
      axis_name: a bound mesh or pmap axis, or a tuple of mesh axes, slowest link first (e.g.
        ``("host", "local")``): exact over the trailing axes, ``compressor`` only across the
        first, on each device's share of every bucket (:mod:`jaxcomm.comm.two_level`); the
        state then comes from ``jc.init_state(..., axis_size=(S, L))``.
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
    out, new, *_ = reduce_tree(
        tree, state, axis_name, compressor, bucket_bytes, mean=False, op="all_reduce"
    )
    return out, new


def compressed_pmean(
    tree: PyTree,
    state: ReduceState | None,
    *,
    axis_name: AxisName,
    compressor: Compressor,
    bucket_bytes: int | None = None,
) -> tuple[PyTree, ReduceState | None]:
    """Mean of ``tree`` over ``axis_name``; see :func:`compressed_psum`.

    Integer and bool leaves give a floating mean, exactly as ``lax.pmean``.

    Jitting it yourself with the state donated: put the state first, in the arguments (before
    donated gradients) and in the outputs (before the mean). Donated buffers are paired with
    outputs of their shape in order, so a mean returned first can take an error buffer's place;
    XLA then copies that buffer to keep the old residual a non-finite step needs.
    ``jc.make_train_step`` does this for you.

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
    out, new, *_ = reduce_tree(
        tree, state, axis_name, compressor, bucket_bytes, mean=True, op="all_reduce"
    )
    return out, new


def compressed_pmean_or_fallback(
    tree: PyTree,
    state: ReduceState | None,
    fallback: PyTree,
    *,
    axis_name: AxisName,
    compressor: Compressor,
    bucket_bytes: int | None = None,
    return_fresh: bool = False,
) -> (
    tuple[PyTree, ReduceState | None, jax.Array]
    | tuple[PyTree, ReduceState | None, jax.Array, PyTree]
):
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
      return_fresh: also return the mean as computed, before the fallback (not finite where
        the mean is not), for consumers that use it only where ``finite``: each reads the
        compressed message again (on GPU its decode fuses into the consumer: OneBit's packed
        signs instead of the written leaves) rather than the leaves written by this call.

    Returns:
      ``(mean or fallback, new state, finite)``, and the fresh mean last with
      ``return_fresh``; ``finite`` is a bool scalar, replicated as the mean is.

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
    out, new, flags, fresh, _ = reduce_tree(
        tree,
        state,
        axis_name,
        compressor,
        bucket_bytes,
        mean=True,
        op="all_reduce",
        fallback=fallback,
    )
    finite = all_of(flags)
    return (out, new, finite, fresh) if return_fresh else (out, new, finite)
