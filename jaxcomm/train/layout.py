"""Where each leaf of a data-parallel state lives: the global and pmap layouts, and views.

A state leaf is either **replicated** (the same value on every device) or **per-device** (the
error feedback of compressed collectives, 0/1 Adam's local momentum). A leaf is per-device
exactly when it sits inside a node of a type marked with :func:`jaxcomm.comm.state.per_device`
where it is defined (``jc.ReduceState``, ``jc.ScatterState``, ``jc.LocalState``, ...; your own
types: ``jc.register_per_device_type``). In the *global* layout used here, with ``n`` devices
on the axis:

* replicated leaves have their local shape and ``PartitionSpec()``;
* per-device leaves are stacked on a new leading axis, shape ``(n, *local_shape)``, with
  ``PartitionSpec(axis_name)``: device ``r`` holds row ``r``.

The *pmap* layout stacks every leaf on a leading axis of size ``n``
(:func:`to_pmap_layout` / :func:`from_pmap_layout` convert).

Parameters are replicated, except with an optimizer whose state type is registered with
``params=True`` (:func:`jaxcomm.zero_one_adam`, :func:`jaxcomm.diloco`), whose local steps make
the parameters differ between devices: then they are per device, stacked ``(n, *shape)`` like
per-device state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm.axes import axis_names
from jaxcomm.comm.state import holds_per_device_params, is_per_device

PyTree = Any


class TrainState(NamedTuple):
    """Parameters and optimizer state of a data-parallel run (an ordinary pytree: checkpoint it
    with orbax as it is)."""

    params: PyTree
    opt_state: PyTree


def _map_by_kind(
    state: PyTree, per_device: Callable, replicated: Callable, keep_blocks: bool = False
) -> PyTree:
    """Apply ``per_device`` to leaves inside per-device nodes, ``replicated`` to all others
    (``keep_blocks``: per-device nodes whose type sets ``_keeps_blocks`` are left as they are)."""

    def visit(node):
        if is_per_device(node):
            if keep_blocks and getattr(type(node), "_keeps_blocks", False):
                return node
            return jax.tree.map(per_device, node)
        return replicated(node)

    return jax.tree.map(visit, state, is_leaf=is_per_device)


def params_are_per_device(opt_state: PyTree) -> bool:
    """Whether the optimizer behind ``opt_state`` keeps parameters per device (0/1 Adam)."""
    found = []

    def visit(node):
        found.append(holds_per_device_params(node))
        return node

    jax.tree.map(visit, opt_state, is_leaf=holds_per_device_params)
    return any(found)


def state_partition_specs(state: PyTree, axis_name: str) -> PyTree:
    """``PartitionSpec(axis_name)`` for every per-device leaf of ``state``, ``P()`` otherwise.

    Works on any pytree (an optimizer state, a :class:`TrainState`, arrays or
    ``ShapeDtypeStruct``s); the result has the structure of ``state`` with specs as leaves. For a
    :class:`TrainState` use :func:`train_state_specs`, which also places the parameters.

    A Flax NNX ``State`` (from ``nnx.split`` / ``nnx.state``) no longer holds the optax
    NamedTuple types that mark per-device leaves, so it is refused: call this on the NNX objects
    (``nnx.state(jc.state_partition_specs((model, optimizer), axis))``) instead.
    """
    _refuse_nnx_state(state)
    return _map_by_kind(state, lambda _: P(axis_name), lambda _: P())


def _refuse_nnx_state(tree: PyTree) -> None:
    # Checked by type name so that jaxcomm does not import flax.
    def is_nnx_state(node) -> bool:
        cls = type(node)
        return cls.__name__ == "State" and cls.__module__.startswith("flax.nnx")

    # The State of a whole split object (or a plain tuple of them). Below the optax NamedTuples
    # (which are tuples too), NNX keeps param-shaped moments as States: that is fine.
    roots = tree if type(tree) in (tuple, list) else (tree,)
    if any(is_nnx_state(root) for root in roots):
        raise TypeError(
            "jaxcomm: state_partition_specs got a flax.nnx State, which has lost the optax "
            "state types that mark per-device leaves (every leaf would look replicated). Call it "
            "on the NNX objects instead: nnx.state(jc.state_partition_specs((model, optimizer), "
            "axis_name))."
        )


def train_state_specs(state: TrainState, axis_name: str) -> TrainState:
    """Specs of a :class:`TrainState`: parameters ``P(axis)`` for 0/1 Adam, else ``P()``."""
    param_spec = P(axis_name) if params_are_per_device(state.opt_state) else P()
    return TrainState(
        params=jax.tree.map(lambda _: param_spec, state.params),
        opt_state=state_partition_specs(state.opt_state, axis_name),
    )


def _rows(tree: PyTree, fn: Callable, keep_blocks: bool = False) -> PyTree:
    """Apply ``fn`` to the per-device leaves (and per-device parameters of a TrainState)."""
    if isinstance(tree, TrainState):
        per_dev = params_are_per_device(tree.opt_state)
        params = jax.tree.map(fn, tree.params) if per_dev else tree.params
        return TrainState(params, _rows(tree.opt_state, fn, keep_blocks))
    return _map_by_kind(tree, fn, lambda x: x, keep_blocks)


def stack_per_device(local_state: PyTree, n: int) -> PyTree:
    """Global layout from one device's state: per-device leaves repeated ``(n, *shape)``.

    For a state built outside any mapped context (e.g. ``tx.init(params)`` with ``axis_size``),
    before passing it to your own ``shard_map`` with :func:`state_partition_specs`.
    """
    return _rows(local_state, lambda x: repeat(x, n))


def local_view(state: PyTree) -> PyTree:
    """Inside ``shard_map``: per-device leaves arrive as ``(1, *local)`` blocks; drop that axis.

    jaxcomm's own per-device states (error feedback, 0/1 Adam's and DiLoCo's local states) keep
    their blocks: pass them to jaxcomm as they are.
    """
    # Private hook: types marked per_device(_blocks=True) are read in either layout by their
    # code; in blocks, XLA:CPU updates the donated buffers in place (squeezed and back, it copies).
    return _rows(state, lambda x: x[0], keep_blocks=True)


def global_view(state: PyTree) -> PyTree:
    """Inverse of :func:`local_view`, before returning a state from the ``shard_map`` body."""
    return _rows(state, lambda x: x[None], keep_blocks=True)


def init_opt_state(tx: optax.GradientTransformation, params: PyTree, axis_name, n: int):
    """``tx.init(params)`` with ``axis_name`` bound to size ``n``, in the pmap layout.

    The axis is bound with ``jax.vmap(axis_name=...)``, so transformations that read
    ``lax.axis_size`` in ``init`` (all of jaxcomm's) size their error feedback for ``n``
    devices. Every leaf of the result is stacked ``(n, ...)``. For a tuple of axes ``n`` is the
    tuple of their sizes (one nested ``vmap`` each); the result is stacked ``(prod(n), ...)``,
    devices in the order of ``PartitionSpec(axis_name)``.
    """
    names = axis_names(axis_name)
    sizes = tuple(n) if isinstance(n, tuple | list) else (n,)
    fn = lambda _: tx.init(params)  # noqa: E731
    for name, size in reversed(list(zip(names, sizes, strict=True))):
        fn = jax.vmap(fn, axis_name=name, axis_size=size)
    out = fn(jnp.zeros(sizes, jnp.int32))
    total = math.prod(sizes)
    return jax.tree.map(lambda x: x.reshape(total, *x.shape[len(sizes) :]), out)


def from_pmap_layout(state: PyTree) -> PyTree:
    """Every leaf stacked ``(n, ...)`` -> the global layout (replicated leaves: row 0).

    Works on an optimizer state or a :class:`TrainState` (per-device parameters stay stacked).
    """
    if isinstance(state, TrainState):
        per_dev = params_are_per_device(state.opt_state)
        params = state.params if per_dev else jax.tree.map(lambda x: x[0], state.params)
        return TrainState(params, from_pmap_layout(state.opt_state))
    return _map_by_kind(state, lambda x: x, lambda x: x[0])


def to_pmap_layout(state: PyTree, n: int) -> PyTree:
    """Global layout -> every leaf stacked ``(n, ...)`` (replicated leaves broadcast)."""

    def bcast(x):
        return repeat(x, n)

    if isinstance(state, TrainState):
        per_dev = params_are_per_device(state.opt_state)
        params = state.params if per_dev else jax.tree.map(bcast, state.params)
        return TrainState(params, to_pmap_layout(state.opt_state, n))
    return _map_by_kind(state, lambda x: x, bcast)


def params_of(state: TrainState, device: int = 0, *, pmap: bool = False) -> PyTree:
    """One copy of the parameters (for evaluation, export): device ``device``'s copy where they
    are per device or stacked (``pmap=True`` for a pmap-layout state)."""
    if pmap or params_are_per_device(state.opt_state):
        return jax.tree.map(lambda x: _row(x, device), state.params)
    return state.params


def _row(x, index: int):
    """``x[index]``, replicated on ``x``'s mesh when ``x`` is split over one (an Explicit-axis
    mesh needs the result's sharding spelled out)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return x.at[index].get(out_sharding=NamedSharding(sharding.mesh, P()))
    return x[index]


def repeat(x, n: int) -> jax.Array:
    """``x`` repeated on a new leading axis: ``(n, *shape)`` (a broadcast, no copy)."""
    return jnp.broadcast_to(jnp.asarray(x)[None], (n, *jnp.shape(x)))


def initial_train_state(
    tx: optax.GradientTransformation, params: PyTree, axis_name, n
) -> TrainState:
    """``tx.init(params)`` with ``axis_name`` bound to ``n``, in the global layout: per-device
    parameters repeated ``(n, ...)``, replicated ones copied (never the caller's arrays). For a
    tuple of axes ``n`` is the tuple of their sizes."""
    opt_state = from_pmap_layout(init_opt_state(tx, params, axis_name, n))
    if params_are_per_device(opt_state):
        total = math.prod(n) if isinstance(n, tuple | list) else n
        params = jax.tree.map(lambda p: repeat(p, total), params)
    else:
        params = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
    return TrainState(params, opt_state)
