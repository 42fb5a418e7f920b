"""A whole :class:`jaxcomm.TrainState` moved onto another number of devices (elastic restarts).

A checkpoint of a data-parallel run on ``n`` devices holds, besides replicated leaves,
per-device leaves whose meaning and shape depend on ``n``: error feedback, 0/1 Adam's local
momenta, :func:`jaxcomm.sharded`'s optimizer-state slices, 0/1 Adam's per-device parameters.
:func:`reshard_train_state` turns it into the state of the same run on ``m`` devices, in the
global layout of :mod:`jaxcomm.train.layout` (per-device leaves stacked ``(m, ...)``).

Which leaf is which is read from the optimizer state's types, the same registry
``jc.make_train_step`` uses to place them (:func:`jaxcomm.register_per_device_type`):

* **replicated leaves** (Adam's moments, step counts, ...): kept as they are.
* **error feedback** (``jc.ReduceState`` / ``jc.ScatterState`` anywhere in the state): moved by
  :func:`jaxcomm.resize_state`, which gives every new device ``1/m`` of each bucket's *pending
  sum* ``T`` (the gradient information not yet transmitted), then scaled by ``m / n``: jaxcomm's
  optimizers *average* (``compressed_pmean``, ``compressed_pmean_scatter``), so what must carry
  over is the pending contribution to the mean, ``T / n``; the new residuals sum to
  ``T m / n``, i.e. ``T / n`` of the mean on ``m`` devices. (Keeping ``T`` itself would weigh
  the untransmitted information ``n / m`` times more than before the restart.)
* **sharded optimizer state** (``jc.ShardedState``): the inner state's parameter-shaped
  subtrees (and qwZ master shards) are ``n`` rank-major slices of each leaf (leaf flattened,
  zero-padded to ``n * c``, ``c = ceil(numel / n)``); they are joined, cut to ``numel`` and
  re-sliced for ``m``. Its other leaves (the inner step count) are the same on every device and
  are merged as below.
* **DiLoCo** (a ``jc.DiLoCoState`` in the state): delegated to :func:`jaxcomm.resize_diloco_state`
  (same rules: local copies averaged, error feedback through ``resize_state``). With
  ``jc.SparseLoCo`` outer gradients each new device's residual is the mean of the old ones
  (``T / n``: the decayed, untransmitted part of the mean outer gradient is kept).
* **DeMo** (``jc.DemoLocal``): each device's momentum is also what it has not yet sent; every new
  device gets their mean, so the pending part of the gathered mean is kept (rule below).
* **packed means** (``jc.PackedMean``: 1-bit Adam's last mean as it was sent, laid out for
  ``n`` devices): reset, not valid; the optimizer's next step reads its dense copy of the mean
  (kept above with the replicated leaves) and sends a packed mean for ``m`` devices.
* **other per-device leaves** (0/1 Adam's ``LocalState`` momentum and accumulated local
  updates, DiLoCo's local state, your registered types) and **per-device parameters** (0/1
  Adam): **averaged** over the ``n`` devices (in float64; integer and bool leaves take the
  largest value) and given to every new device. Averaging is the choice that keeps a linear
  relation between them (0/1 Adam's ``params - u`` is the parameters at the last
  synchronisation on every device, and stays so); it is exact where the devices agree (right
  after a synchronisation) and otherwise equals one synchronisation's worth of exact averaging.

What it needs. The optimizer ``tx`` and one copy of the parameters (shapes only) give the
state's layout on ``n`` and on ``m`` devices (``tx.init`` with the axis bound, as
``jc.init_train_state`` does). The error feedback's layout also depends on the compressor and
``bucket_bytes`` the optimizer was built with, which the state does not record: pass them
(``compressor=``, ``bucket_bytes=``) when the state holds error feedback.

Restoring an orbax checkpoint of ``n`` devices: :func:`train_state_template` gives the
abstract state to restore into (with any sharding, e.g. one device), then
``reshard_train_state(restored, tx, params, axis_name=..., new_axis_size=m, mesh=mesh_m)``.
Everything runs on the host, in NumPy.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import GetAttrKey

from jaxcomm.comm.packed import PackedMean
from jaxcomm.comm.state import ReduceState, ScatterState, init_state, is_per_device
from jaxcomm.compressors import Compressor
from jaxcomm.elastic.diloco import resize_diloco_state
from jaxcomm.elastic.resize import merge_rows, resize_state
from jaxcomm.optim.diloco.state import DiLoCoState
from jaxcomm.optim.sharded import ShardedState
from jaxcomm.train.layout import (
    TrainState,
    initial_train_state,
    params_are_per_device,
    train_state_specs,
)

PyTree = Any
_COMM_TYPES = (ReduceState, ScatterState)


def train_state_template(
    tx: optax.GradientTransformation,
    params: PyTree,
    *,
    axis_name: str,
    axis_size: int,
    sharding: jax.sharding.Sharding | None = None,
) -> TrainState:
    """The abstract :class:`TrainState` (``jax.ShapeDtypeStruct`` leaves, global layout) of a
    run of ``tx`` on ``axis_size`` devices: the target to restore its checkpoint into.

    ``sharding`` (e.g. ``jax.sharding.SingleDeviceSharding(jax.devices()[0])``) is given to
    every leaf, so a checkpoint of ``n`` devices can be read on a machine with fewer.
    """
    _check_size("axis_size", axis_size)

    n = int(axis_size)
    abstract = jax.eval_shape(lambda p: initial_train_state(tx, p, axis_name, n), params)
    if sharding is None:
        return abstract
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract
    )


def _check_size(name: str, value) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"jaxcomm: {name} must be a positive int, got {value!r}")


def _shard_rows(full: np.ndarray, m: int) -> np.ndarray:
    """A flat leaf -> its ``(m, c)`` rank-major slices, zero-padded (``jc.sharded``'s layout)."""
    c = -(-full.size // m)
    out = np.zeros((m * c,), full.dtype)
    out[: full.size] = full
    return out.reshape(m, c)


class _Context:
    def __init__(self, params, n, m, compressor, bucket_bytes):
        self.params, self.n, self.m = params, n, m
        self.compressor, self.bucket_bytes = compressor, bucket_bytes
        self.param_leaves, self.param_def = jax.tree.flatten(params)
        self.sizes = [math.prod(np.shape(p)) for p in self.param_leaves]


def _where(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _resize_comm(path, old, new_template, ctx: _Context):
    """Error feedback through :func:`jaxcomm.resize_state` (its pending sum is preserved)."""
    if not jax.tree.leaves(old):
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), new_template)
    op = "all_reduce" if isinstance(old, ReduceState) else "reduce_scatter"
    if ctx.compressor is None:
        raise ValueError(
            f"jaxcomm: reshard_train_state: the state holds error feedback at opt_state"
            f"{_where(path)} ({type(old).__name__}); pass compressor= (and bucket_bytes= if not "
            "None) as given to the optimizer, so that its layout is known"
        )
    local = [tuple(np.shape(x)[1:]) for x in jax.tree.leaves(old)]
    # jaxcomm's optimizers build error feedback for the parameters or for fp32 copies of them.
    candidates = [ctx.params, jax.tree.map(lambda p: np.zeros(np.shape(p), np.float32), ctx.params)]
    for tree in candidates:
        template = init_state(
            ctx.compressor, tree, axis_size=ctx.n, bucket_bytes=ctx.bucket_bytes, op=op
        )
        same = jax.tree.structure(template) == jax.tree.structure(old) and local == [
            tuple(np.shape(x)) for x in jax.tree.leaves(template)
        ]
        if same:
            new = resize_state(
                old,
                ctx.compressor,
                tree,
                axis_size=ctx.n,
                new_axis_size=ctx.m,
                bucket_bytes=ctx.bucket_bytes,
                op=op,
            )
            # resize_state keeps the pending *sum*; the optimizers average, so keep the pending
            # *mean* T / n instead (it is linear: scale the residuals by m / n).
            return new._replace(
                buckets=jax.tree.map(lambda x: (x * (ctx.m / ctx.n)).astype(x.dtype), new.buckets)
            )
    raise ValueError(
        f"jaxcomm: reshard_train_state: the error feedback at opt_state{_where(path)} "
        f"({type(old).__name__}, per-device shapes {local}) does not fit compressor "
        f"{ctx.compressor!r}, bucket_bytes={ctx.bucket_bytes} and these params on {ctx.n} "
        "devices: pass the compressor and bucket_bytes the optimizer was built with"
    )


def _leaf(path, old, new_template, ctx: _Context) -> np.ndarray:
    """A per-device leaf that is not error feedback or a shard: merged over devices."""
    rows = np.asarray(old)
    want = (ctx.m, *rows.shape[1:])
    if tuple(new_template.shape) != want:
        raise ValueError(
            f"jaxcomm: reshard_train_state: per-device leaf opt_state{_where(path)} has shape "
            f"{rows.shape} on {ctx.n} devices but {tuple(new_template.shape)} on {ctx.m}: its "
            "layout depends on the device count in a way this function does not know (a "
            "registered per-device type of your own?)"
        )
    return merge_rows(rows, ctx.m, accumulate=np.float64)


def _is_shard_tree(node, ctx: _Context) -> bool:
    """Whether ``node`` is a parameter-shaped tree of ``(n, c_i)`` rank-major slices."""
    try:
        leaves, treedef = jax.tree.flatten(node)
    except Exception:  # noqa: BLE001 - not a pytree node we can compare
        return False
    if treedef != ctx.param_def:
        return False
    n = ctx.n
    return all(
        tuple(np.shape(x)) == (n, -(-size // n)) for x, size in zip(leaves, ctx.sizes, strict=True)
    )


def _reslice(old, ctx: _Context):
    def one(x, size):
        rows = np.asarray(x)
        return _shard_rows(rows.reshape(-1)[:size], ctx.m)

    leaves = jax.tree.leaves(old)
    return jax.tree.unflatten(
        ctx.param_def, [one(x, s) for x, s in zip(leaves, ctx.sizes, strict=True)]
    )


def _per_device(path, old, new_template, ctx: _Context, *, shards: bool = False):
    """A per-device node: comm states resized, shard trees re-sliced, other leaves merged."""

    def is_node(x):
        return isinstance(x, _COMM_TYPES) or (shards and _is_shard_tree(x, ctx))

    def visit(sub_path, sub, tpl):
        full_path = (*path, *sub_path)
        if isinstance(sub, _COMM_TYPES):
            return _resize_comm(full_path, sub, tpl, ctx)
        if shards and _is_shard_tree(sub, ctx):
            out = _reslice(sub, ctx)
            for (p, got), want in zip(
                jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(tpl), strict=True
            ):
                if got.shape != tuple(want.shape):
                    raise ValueError(
                        f"jaxcomm: reshard_train_state: shard leaf opt_state"
                        f"{_where((*full_path, *p))} re-sliced to {got.shape}, but the optimizer "
                        f"on {ctx.m} devices has {tuple(want.shape)}"
                    )
            return out
        return _leaf(full_path, sub, tpl, ctx)

    if isinstance(old, ShardedState):
        fields = dict(
            inner=_per_device(
                (*path, GetAttrKey("inner")), old.inner, new_template.inner, ctx, shards=True
            ),
            comm=_per_device((*path, GetAttrKey("comm")), old.comm, new_template.comm, ctx),
            master=_per_device(
                (*path, GetAttrKey("master")), old.master, new_template.master, ctx, shards=True
            ),
        )

        # Any other field (e.g. skip counters) is the same on every device (the step is
        # skipped on all of them at once): its largest row, on every new device.
        def largest_row(x):
            row = np.max(np.asarray(x), axis=0)
            return np.broadcast_to(row, (ctx.m, *row.shape)).copy()

        for name in old._fields:
            if name not in fields:
                fields[name] = jax.tree.map(largest_row, getattr(old, name))
        return ShardedState(**fields)
    return jax.tree_util.tree_map_with_path(visit, old, new_template, is_leaf=is_node)


def _contains(tree: PyTree, cls: type) -> bool:
    found = []

    def visit(node):
        found.append(isinstance(node, cls))
        return node

    jax.tree.map(visit, tree, is_leaf=lambda x: isinstance(x, cls))
    return any(found)


def _infer_axis_size(state: TrainState) -> int | None:
    rows = []

    def visit(node):
        if is_per_device(node):
            rows.extend(np.shape(x)[0] for x in jax.tree.leaves(node))
        return node

    jax.tree.map(visit, state.opt_state, is_leaf=is_per_device)
    if params_are_per_device(state.opt_state):
        rows.extend(np.shape(x)[0] for x in jax.tree.leaves(state.params))
    if not rows:
        return None
    if len(set(rows)) != 1:
        raise ValueError(
            f"jaxcomm: reshard_train_state: per-device leaves have different leading sizes "
            f"{sorted(set(rows))}; is this a TrainState in the global layout (pass axis_size=)?"
        )
    return int(rows[0])


def reshard_train_state(
    state: TrainState,
    tx: optax.GradientTransformation,
    params: PyTree,
    *,
    axis_name: str,
    new_axis_size: int,
    axis_size: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    mesh: Mesh | None = None,
) -> TrainState:
    """The :class:`jaxcomm.TrainState` of ``axis_size`` devices as a state for ``new_axis_size``.

    Args:
      state: a :class:`TrainState` in the global layout (as ``jc.make_train_step`` keeps it and
        orbax saves it), host or device arrays.
      tx: the optimizer the state belongs to (the same transformation runs on the new devices).
      params: one copy of the parameters or their ``ShapeDtypeStruct``s (shapes and dtypes).
      axis_name: the data-parallel axis ``tx`` communicates over.
      new_axis_size: devices the run continues on.
      axis_size: devices the state was saved on; by default read from its per-device leaves.
      compressor, bucket_bytes: what ``tx``'s compressed collectives were built with; needed
        when the state holds error feedback (1-bit Adam's, ``compressed_mean``'s, ...).
      mesh: if given, the result is placed on it (``jc.train_state_specs``); else NumPy arrays.

    Returns:
      The state for ``new_axis_size`` devices (module docstring: what happens to each kind of
      leaf). Raises ``ValueError`` if ``state`` is not ``tx``'s state on ``axis_size`` devices.
    """
    if not isinstance(state, TrainState):
        raise TypeError(
            f"jaxcomm: reshard_train_state takes a jc.TrainState, got {type(state).__name__}"
        )
    _check_size("new_axis_size", new_axis_size)
    n = _infer_axis_size(state) if axis_size is None else axis_size
    m = int(new_axis_size)
    if n is None:  # nothing per device: every leaf is replicated
        n = m
    _check_size("axis_size", n)
    n = int(n)
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)
    old_t = train_state_template(tx, params, axis_name=axis_name, axis_size=n)
    new_t = train_state_template(tx, params, axis_name=axis_name, axis_size=m)
    if jax.tree.structure(state) != jax.tree.structure(old_t):
        raise ValueError(
            "jaxcomm: reshard_train_state: the state's structure does not match tx.init(params) "
            f"(got {jax.tree.structure(state)}, expected {jax.tree.structure(old_t)}); is it the "
            "state of this optimizer and these parameters?"
        )
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(old_t), strict=True
    ):
        if tuple(np.shape(got)) != tuple(want.shape):
            raise ValueError(
                f"jaxcomm: reshard_train_state: leaf {_where(path)} has shape {np.shape(got)}, "
                f"expected {tuple(want.shape)} for this optimizer on {n} devices (saved with "
                "another axis_size, or not in the global layout?)"
            )
    ctx = _Context(params, n, m, compressor, bucket_bytes)

    def visit(path, old, new):
        if isinstance(old, PackedMean):  # laid out for n devices: the dense copy is read once
            return jax.tree.map(lambda t: np.zeros(t.shape, t.dtype), new)
        if is_per_device(old):
            return _per_device(path, old, new, ctx)
        if tuple(np.shape(old)) != tuple(new.shape):
            raise ValueError(
                f"jaxcomm: reshard_train_state: replicated leaf opt_state{_where(path)} has "
                f"shape {np.shape(old)} on {n} devices but {tuple(new.shape)} on {m}: this "
                "optimizer's state depends on the device count in a way only it knows (use its "
                "own resize function, if it has one)"
            )
        return np.asarray(old)

    if _contains(state.opt_state, DiLoCoState):
        out = resize_diloco_state(state, compressor, new_axis_size=m, bucket_bytes=bucket_bytes)
    else:
        opt_state = jax.tree_util.tree_map_with_path(
            visit,
            state.opt_state,
            new_t.opt_state,
            is_leaf=lambda x: is_per_device(x) or isinstance(x, PackedMean),
        )
        if params_are_per_device(state.opt_state):
            new_params = jax.tree.map(
                lambda p: merge_rows(np.asarray(p), m, accumulate=np.float64), state.params
            )
        else:
            new_params = jax.tree.map(np.asarray, state.params)
        out = TrainState(new_params, opt_state)
    if mesh is None:
        return out
    specs = train_state_specs(out, axis_name)
    return jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        out,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
