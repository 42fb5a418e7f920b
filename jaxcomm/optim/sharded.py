"""Sharded data parallelism (ZeRO stages 1-2) over compressed reduce-scatter and all-gather.

:func:`sharded` wraps any optax transformation so that each of the ``n`` devices of the
data-parallel axis keeps the optimizer state of only its ``1/n`` share of the parameters
(Rajbhandari et al., *ZeRO*, 2020, stages 1-2), and the two collectives this needs can be
compressed (Wang et al., *ZeRO++*, 2023: qgZ for the gradients, qwZ for the weights). One
step, on device ``r`` of ``n``, with ``g`` its local gradients and ``p`` the replicated
parameters:

1. ``g_r = compressed_pmean_scatter(g)``: the mean gradient's slice ``r`` of every leaf, in
   DeepSpeed's rank-major layout (leaf flattened, zero-padded to ``n * c``, ``c = ceil(numel /
   n)``, device ``r`` owns ``[r*c, (r+1)*c)``), one collective chain per bucket, with the
   compressor's error feedback (``init_state(..., op="reduce_scatter")``) when it has one.
2. ``p_r``: this device's slice of ``p`` in the same layout (or its master copy, see below).
3. ``u_r, s_r = tx.update(g_r, s_r, p_r)``; ``p_r' = p_r + u_r``: the inner transformation only
   ever sees 1-D shards (weight decay, Lion, masks by shape-independent rules all work; a
   transformation that needs a leaf's 2-D shape, e.g. a per-matrix norm, does not).
4. ``p' = compressed_all_gather(p_r')``: exact, or blockwise int8/int4 (``gather_compressor=
   jc.Quantize(bits=8)``, ZeRO++'s qwZ).

The result is returned as an optax update ``p' - p``, so the wrapper drops into
``jc.make_train_step``, ``nnx.Optimizer`` or a hand-written step like any other transformation
(``p + (p' - p)`` equals ``p'`` up to one rounding of the subtraction; every device computes the
same value, so replicas never drift apart).

Master weights. With a lossy gather the gathered parameters are only an approximation of the
updated ones; re-slicing them every step would quantize the weights themselves and lose every
update smaller than a quantization step. The state then also holds ``master``: this device's
exact parameter shard (ZeRO++ keeps the full-precision partition on its owner, too), which is
what the inner transformation updates. (Where ``init`` runs outside the axis, no device knows
its index yet: the master is then marked invalid and taken from ``p`` at the first update.)
With an exact gather the slice of ``p`` *is* the master
shard and nothing extra is stored.

State. :class:`ShardedState` is per device as a whole (it is marked with
:func:`jaxcomm.comm.state.per_device`): under ``make_train_step`` every leaf is
stacked ``(n, ...)`` with ``PartitionSpec(axis)``, so device ``r`` holds ``s_r`` only: the
inner state is ``1/n`` of plain data parallelism's, plus at most ``n - 1`` padding elements per
leaf, plus any scalars the inner state keeps (its step count, once per device).

Bytes per device per step, ring model, fp32 parameters of ``N`` elements: exact scatter + gather
``2 (n-1)/n * 4N``, the same as the all-reduce of plain data parallelism; with int8 gradients
and int8 weights about ``2 (n-1)/n * N`` (plus one fp32 scale per block): about 4x fewer
bytes than fp32.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend.core import Var

from jaxcomm._compat import bound_axis_size
from jaxcomm.comm.axes import AxisName, canonical_axis
from jaxcomm.comm.scatter_gather import (
    compressed_all_gather,
    compressed_pmean_scatter,
    shard_shapes,
)
from jaxcomm.comm.state import ScatterState, init_state, per_device
from jaxcomm.compressors import Compressor, NoCompression
from jaxcomm.guard import SkipCounters, keep_if
from jaxcomm.optim._common import check_compressor, resolve_axis_size, static_bucket_bytes
from jaxcomm.optim._skip import all_finite, count_skips, on_every_device, zeros_unless

PyTree = Any


@per_device
class ShardedState(NamedTuple):
    """State of :func:`sharded`; every leaf is private to its device.

    Attributes:
      inner: the inner transformation's state for this device's flat parameter shards
        (leaves ``(c,)`` with ``c = ceil(numel / n)``).
      comm: error feedback of the compressed reduce-scatter (``jc.ScatterState``; no leaves for
        exact or feedback-free compressors).
      master: a :class:`MasterShards` when the gather is lossy, else ``()``.
      skips: the steps skipped because the mean gradient or the update was not finite, in a
        row and in all (:class:`~jaxcomm.guard.SkipCounters`, int32 scalars, the same on every
        device: they skip together).
    """

    inner: PyTree
    comm: ScatterState
    master: MasterShards | tuple
    skips: SkipCounters


class MasterShards(NamedTuple):
    """This device's exact parameter shards, kept when the all-gather is lossy (qwZ).

    Attributes:
      shards: one ``(c,)`` array per parameter leaf, the parameters' dtype.
      valid: bool scalar; ``False`` when ``init`` ran outside the axis (the shards are then
        zeros and the first update slices them from the parameters).
    """

    shards: PyTree
    valid: jax.Array


def shard_of(tree: PyTree, index: jax.Array | int, axis_size: int) -> PyTree:
    """Device ``index``'s slice of every leaf in the rank-major layout of the scatter.

    Leaf ``x`` is flattened, zero-padded to ``n * c`` (``c = ceil(x.size / n)``) and row
    ``index`` of its ``(n, c)`` view is returned: exactly what
    :func:`jaxcomm.compressed_psum_scatter` gives device ``index`` for that leaf.
    """

    def one(x):
        x = jnp.asarray(x)
        size = x.size
        c = -(-size // axis_size)
        rows = jnp.pad(jnp.ravel(x), (0, axis_size * c - size)).reshape(axis_size, c)
        return lax.dynamic_index_in_dim(rows, index, axis=0, keepdims=False)

    return jax.tree.map(one, tree)


def _depends_on_inputs(fn, *args) -> bool:
    """Whether any output of ``fn`` depends on the *values* of its inputs (not just shapes)."""
    closed = jax.make_jaxpr(fn)(*args)
    dependent = set(closed.jaxpr.invars)
    for eqn in closed.jaxpr.eqns:
        if any(isinstance(v, Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return any(isinstance(v, Var) and v in dependent for v in closed.jaxpr.outvars)


def _axis_index(axis_name: AxisName) -> jax.Array | None:
    try:
        return lax.axis_index(axis_name)
    except NameError:
        return None


def sharded(
    tx: optax.GradientTransformation,
    axis_name: AxisName,
    *,
    compressor: Compressor | None = None,
    gather_compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    max_consecutive_skips: int | None = 16,
) -> optax.GradientTransformation:
    """``tx`` applied ZeRO-style: each device updates only its ``1/n`` share of the parameters.

    ``update(grads, state, params)`` takes this device's **local** gradients (it does the
    communication), needs ``params`` and returns ``new_params - params``, identical on every
    device; see the module docstring for the algorithm and the cost.

    Args:
      tx: any optax transformation that does not communicate itself (``optax.adamw(...)``,
        ``optax.lion(...)``, a chain with clipping by a per-leaf rule, ...). It sees the mean
        gradient's shards, 1-D.
      axis_name: the data-parallel axis (bound where ``update`` runs: ``shard_map``/``pmap``),
        or a tuple of mesh axes, slowest first: the state is sharded over every device, the
        reduce-scatter and the gather exact inside the fast axes and compressed only across
        the first (:mod:`jaxcomm.comm.two_level`).
      compressor: reduce-scatter compressor, e.g. ``jc.Quantize(bits=8)`` or ``bits=4`` (qgZ),
        ``jc.OneBit()``; with error feedback where the compressor keeps one. Default exact.
      gather_compressor: all-gather compressor for the updated parameters: ``None`` (exact) or
        e.g. ``jc.Quantize(bits=8)`` (qwZ; then an exact master shard is kept per device).
      bucket_bytes: bucket size of both collectives (``None``: one bucket per dtype).
      axis_size: size of the axis for ``init`` when it runs outside the axis (the
        ``nnx.Optimizer`` / :func:`jaxcomm.stack_per_device` route); else read from the axis.
      max_consecutive_skips: stop (``FloatingPointError``) once more than this many steps in
        a row were skipped as non-finite; ``None``: never (no per-step host callback).

    ``init`` slices this device's parameter shard where the axis is bound (under
    ``jc.make_train_step``, ``jc.init_opt_state`` or ``pmap``). Outside it, the inner state is
    built from device 0's shard, which is correct for every device only when the inner
    ``init`` uses just the shapes (Adam's and Lion's zero moments do); one that stores parameter
    values (e.g. lookahead) is refused there with an error.
    """
    axis_name = canonical_axis(axis_name)
    compressor = NoCompression() if compressor is None else compressor
    gather_compressor = NoCompression() if gather_compressor is None else gather_compressor
    check_compressor(compressor)
    check_compressor(gather_compressor)
    bucket_bytes = static_bucket_bytes(bucket_bytes)
    keep_master = gather_compressor.lossy

    def init_fn(params):
        sizes = resolve_axis_size(axis_name, axis_size)
        n = math.prod(sizes) if isinstance(sizes, tuple) else sizes  # shards over every device
        index = _axis_index(axis_name)
        unbound = index is None
        if unbound:
            shapes = shard_shapes(params, n)
            if _depends_on_inputs(tx.init, jax.tree.map(jnp.zeros_like, shapes)):
                raise ValueError(
                    "jaxcomm.sharded: the inner transformation's init stores parameter values, "
                    f"so each device needs its own shard: call init where axis {axis_name!r} is "
                    "bound (jc.make_train_step, jc.init_opt_state, pmap)"
                )
            index = 0
        shards = shard_of(params, index, n)
        comm = init_state(
            compressor, params, axis_size=sizes, bucket_bytes=bucket_bytes, op="reduce_scatter"
        )
        master = ()
        if keep_master:
            master = MasterShards(
                jax.tree.map(jnp.zeros_like, shards) if unbound else shards,
                jnp.asarray(not unbound),
            )
        return ShardedState(tx.init(shards), comm, master, SkipCounters.zeros())

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "jaxcomm.sharded needs params: call update(grads, state, params) (the new "
                "parameters are gathered from every device's updated shard)"
            )
        n = bound_axis_size(axis_name)
        index = lax.axis_index(axis_name)
        grads, comm = compressed_pmean_scatter(
            updates,
            state.comm,
            axis_name=axis_name,
            compressor=compressor,
            bucket_bytes=bucket_bytes,
        )
        own = shard_of(params, index, n)
        if keep_master:
            valid = state.master.valid
            own = jax.tree.map(lambda m, p: jnp.where(valid, m, p), state.master.shards, own)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, own)
        shard_updates, inner = tx.update(grads, state.inner, own)
        new_own = optax.apply_updates(own, shard_updates)
        gathered, _ = compressed_all_gather(
            new_own,
            None,
            axis_name=axis_name,
            compressor=gather_compressor,
            like=params,
            bucket_bytes=bucket_bytes,
        )
        delta = jax.tree.map(
            lambda new, p: (new - p).astype(jnp.asarray(p).dtype), gathered, params
        )
        master = MasterShards(new_own, jnp.ones_like(valid)) if keep_master else ()
        # A non-finite mean gradient or update on any device skips the step on every device
        # (one int32 pmin): the inner state and the master shards stay, nothing moves; the
        # collectives' guard kept the error feedback.
        ok = on_every_device(all_finite(shard_updates, inner), axis_name)
        inner = keep_if(ok, inner, state.inner)
        # The scatter's guard is per device: devices whose own shard of the mean was finite
        # advanced their error feedback; a skipped step must leave it on every device.
        comm = keep_if(ok, comm, state.comm)
        if keep_master:
            master = keep_if(ok, master, MasterShards(own, valid))
        skips = count_skips(ok, state.skips, max_consecutive_skips, "sharded")
        return zeros_unless(ok, delta), ShardedState(inner, comm, master, skips)

    return optax.GradientTransformation(init_fn, update_fn)
