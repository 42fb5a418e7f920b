"""Data-parallel training steps and the layout of optimizer states across devices.

Layout. A state leaf is either **replicated** (the same value on every device) or
**per-device** (the error feedback of compressed collectives, 0/1 Adam's local momentum). A leaf
is per-device exactly when it sits inside a node of a type marked with
:func:`jaxcomm.state.per_device` where it is defined (``jc.ReduceState``, ``jc.ScatterState``,
``jc.LocalState``, ...; your own types: :func:`register_per_device_type`). In the *global*
layout used here, with ``n`` devices on the axis:

* replicated leaves have their local shape and ``PartitionSpec()``;
* per-device leaves are stacked on a new leading axis, shape ``(n, *local_shape)``, with
  ``PartitionSpec(axis_name)``: device ``r`` holds row ``r``.

The *pmap* layout stacks every leaf on a leading axis of size ``n``
(:func:`to_pmap_layout` / :func:`from_pmap_layout` convert).

Parameters are replicated, except with :func:`jaxcomm.zero_one_adam` (detected by a
``ZeroOneAdamState`` anywhere in the optimizer state), whose local steps make the parameters
differ between devices: then they are per device, stacked ``(n, *shape)`` like per-device state.

Train steps. :func:`make_train_step` (``shard_map`` over a mesh) and
:func:`make_pmap_train_step` (``jax.pmap``) build a jitted step ``step(state, batch) ->
(state, metrics)`` and its initial :class:`TrainState`. Both take the same *global* batch
(every leaf's leading axis is split over the devices). The transformation receives each
device's **local** gradients and does the communication (``jc.compressed_mean``,
``jc.onebit_adam``, ``jc.zero_one_adam``, or your own); for exact data parallelism chain
``jc.compressed_mean(axis, jc.NoCompression())`` in front of any optax optimizer. Under
``shard_map`` the step takes gradients with respect to a device-varying copy of the
parameters, so JAX inserts no implicit fp32 ``psum`` of the gradients (which it otherwise does
for replicated inputs); a transformation that returns device-varying updates for replicated
parameters is refused at trace time by ``check_vma`` instead of silently diverging.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm._compat import ensure_varying
from jaxcomm.comm.state import (
    block_types,
    holds_per_device_params,
    is_per_device,
    per_device_types,
)
from jaxcomm.comm.state import register_per_device_type as register_per_device_type
from jaxcomm.phases import PhasedStep, record_phases
from jaxcomm.train.placement import place_batch
from jaxcomm.train.step import DEFAULT_MAX_IN_FLIGHT, TrainStep

PyTree = Any


def __getattr__(name: str):
    # The registries live in jaxcomm.state; these read-only views are always current.
    if name == "PER_DEVICE_TYPES":
        return per_device_types()
    if name == "PER_DEVICE_PARAMS_TYPES":
        return per_device_types(params=True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TrainState(NamedTuple):
    """Parameters and optimizer state of a data-parallel run (an ordinary pytree: checkpoint it
    with orbax as it is)."""

    params: PyTree
    opt_state: PyTree


def _map_by_kind(
    state: PyTree, per_device: Callable, replicated: Callable, keep: tuple[type, ...] = ()
) -> PyTree:
    """Apply ``per_device`` to leaves inside per-device nodes, ``replicated`` to all others
    (per-device nodes of a ``keep`` type are left as they are)."""

    def visit(node):
        if is_per_device(node):
            if isinstance(node, keep):
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


def _rows(tree: PyTree, fn: Callable, keep: tuple[type, ...] = ()) -> PyTree:
    """Apply ``fn`` to the per-device leaves (and per-device parameters of a TrainState)."""
    if isinstance(tree, TrainState):
        per_dev = params_are_per_device(tree.opt_state)
        params = jax.tree.map(fn, tree.params) if per_dev else tree.params
        return TrainState(params, _rows(tree.opt_state, fn, keep))
    return _map_by_kind(tree, fn, lambda x: x, keep)


def stack_per_device(local_state: PyTree, n: int) -> PyTree:
    """Global layout from one device's state: per-device leaves repeated ``(n, *shape)``.

    For a state built outside any mapped context (e.g. ``tx.init(params)`` with ``axis_size``),
    before passing it to your own ``shard_map`` with :func:`state_partition_specs`.
    """
    return _rows(local_state, lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n, *jnp.shape(x))))


def local_view(state: PyTree) -> PyTree:
    """Inside ``shard_map``: per-device leaves arrive as ``(1, *local)`` blocks; drop that axis.

    States of the types registered with ``per_device(blocks=True)`` stay blocks (the error
    feedback ``jc.ReduceState`` / ``jc.ScatterState``, 0/1 Adam's ``jc.LocalState``): the code
    that reads them takes either layout, and in the block layout XLA updates the donated buffers
    in place (squeezed and back, XLA:CPU writes a fresh buffer and copies it).
    """
    return _rows(state, lambda x: x[0], block_types())


def global_view(state: PyTree) -> PyTree:
    """Inverse of :func:`local_view`, before returning a state from the ``shard_map`` body."""
    return _rows(state, lambda x: x[None], block_types())


def init_opt_state(tx: optax.GradientTransformation, params: PyTree, axis_name: str, n: int):
    """``tx.init(params)`` with ``axis_name`` bound to size ``n``, in the pmap layout.

    The axis is bound with ``jax.vmap(axis_name=...)``, so transformations that read
    ``lax.axis_size`` in ``init`` (all of jaxcomm's) size their error feedback for ``n``
    devices. Every leaf of the result is stacked ``(n, ...)``.
    """
    return jax.vmap(lambda _: tx.init(params), axis_name=axis_name, axis_size=n)(
        jnp.zeros((n,), jnp.int32)
    )


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
        x = jnp.asarray(x)
        return jnp.broadcast_to(x[None], (n, *x.shape))

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


def _split_batch_spec(axis_name: str, batch: PyTree) -> PyTree:
    return jax.tree.map(lambda _: P(axis_name), batch)


def _loss_and_grads(loss_fn, has_aux, params, batch):
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss, aux = out if has_aux else (out, None)
    return loss, aux, grads


def _mean_metrics(loss, aux, axis_name: str, has_aux: bool):
    loss = lax.pmean(loss, axis_name)
    if not has_aux:
        return loss
    return loss, jax.tree.map(lambda x: lax.pmean(x, axis_name), aux)


def _local_train_step(
    loss_fn, tx, axis_name, has_aux, state: TrainState, batch, varying: bool, blocks=None
):
    """One device's step: local grads -> ``tx`` (which communicates) -> new params.

    ``blocks``: the per-device parameters as the ``(1, *local)`` blocks shard_map hands them;
    the update is added to the blocks themselves, so that XLA writes them in place (through a
    squeeze and its inverse it would copy every parameter on XLA:CPU).
    """
    params = state.params
    grad_params = (
        jax.tree.map(lambda p: ensure_varying(p, axis_name), params) if varying else params
    )
    loss, aux, grads = _loss_and_grads(loss_fn, has_aux, grad_params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    if blocks is None:
        new_params = optax.apply_updates(params, updates)
    else:
        new_params = optax.apply_updates(
            blocks, jax.tree.map(lambda u, b: u.reshape(b.shape), updates, blocks)
        )
    return TrainState(new_params, opt_state), _mean_metrics(loss, aux, axis_name, has_aux)


def init_train_state(
    mesh: Mesh, axis_name: str, tx: optax.GradientTransformation, params: PyTree
) -> TrainState:
    """The initial :class:`TrainState` of :func:`make_train_step`, placed on ``mesh``.

    ``tx.init`` runs once, jitted, with ``axis_name`` bound to the mesh's size; every leaf is
    created directly with its sharding (per-device leaves ``P(axis)``, the rest replicated).
    The caller's ``params`` are copied, never aliased (the step donates its input).
    """
    if axis_name not in mesh.shape:
        raise ValueError(
            f"jaxcomm: axis {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}"
        )
    n = int(mesh.shape[axis_name])

    def build(params):
        opt_state = from_pmap_layout(init_opt_state(tx, params, axis_name, n))
        if params_are_per_device(opt_state):
            params = jax.tree.map(lambda p: jnp.broadcast_to(p[None], (n, *jnp.shape(p))), params)
        else:
            params = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
        return TrainState(params, opt_state)

    abstract = jax.eval_shape(build, params)
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        train_state_specs(abstract, axis_name),
        is_leaf=lambda x: isinstance(x, P),
    )
    return jax.jit(build, out_shardings=shardings)(params)


def make_train_step(
    mesh: Mesh,
    axis_name: str,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    params: PyTree,
    *,
    has_aux: bool = False,
    donate: bool = True,
    check_vma: bool = True,
    specialize_phases: bool = True,
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
) -> tuple[TrainStep, TrainState]:
    """A jitted ``shard_map`` data-parallel train step and its initial state.

    Args:
      mesh: the device mesh; ``axis_name`` is its data-parallel axis (other axes, if any, see
        the step replicated).
      axis_name: the axis the batch is split over and ``tx`` communicates over.
      loss_fn: ``loss_fn(params, local_batch) -> loss`` (or ``(loss, aux)`` with
        ``has_aux=True``), the mean over the local batch.
      tx: an optax transformation that takes local gradients and communicates, e.g.
        ``optax.chain(jc.compressed_mean(axis_name), optax.adam(1e-3))`` or
        ``jc.onebit_adam(1e-3, axis_name=axis_name)``. Its ``init`` is called with the axis
        bound to the mesh's size.
      params: one copy of the initial parameters.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` leaves are averaged over
        devices.
      donate: donate the input state's buffers to the step (do not reuse a state after passing
        it to ``step``; copy it first, e.g. ``jax.tree.map(jnp.copy, state)``).
      check_vma: passed to ``jax.shard_map``.
      specialize_phases: compile each phase of ``tx``'s schedule as its own program and pick
        it on the host per step (a :class:`jaxcomm.phases.PhasedStep`): the warm-up and the
        compressed steps of ``jc.onebit_adam`` / ``jc.onebit_lamb`` / ``jc.compressed_mean``,
        0/1 Adam's four kinds of step, DiLoCo's inner and synchronising steps. Same results up
        to fp32 rounding, no ``lax.cond`` / ``lax.switch`` left in the program (whose
        pass-through copies and per-phase selects every step would pay), one compile per phase
        seen. Each call reads the phase of its input state first (a few scalar ops), so the
        host runs at most one step ahead. ``False``: one program for every phase.
      max_in_flight: how many steps the host may dispatch ahead of the device before a call
        waits for the oldest (``None``: no bound). See :class:`jaxcomm.train.TrainStep`.

    Returns:
      ``(step, state)``: ``step(state, batch) -> (state, metrics)`` (a
      :class:`jaxcomm.train.TrainStep`) where ``batch`` is the global batch: NumPy arrays or
      any ``jax.Array``s whose leading axis is split over ``axis_name`` (placed by the step;
      with several processes, each passes its own rows), and ``metrics`` the mean loss over
      devices (``(loss, aux)`` with ``has_aux``); ``state`` is the initial :class:`TrainState`
      in the global layout (see the module docstring), placed on ``mesh``.
      ``step.lower(state, batch).compile().as_text()`` gives the HLO of the program that state
      runs. Works on Explicit-axis meshes (``jax.make_mesh``'s default) and Auto ones.
    """
    state = init_train_state(mesh, axis_name, tx, params)

    def global_step(state: TrainState, batch, probe: bool = False):
        specs = train_state_specs(state, axis_name)

        def body(state, batch):
            blocks = state.params if params_are_per_device(state.opt_state) else None
            if probe:  # the phases only: the step itself is dead code
                with record_phases() as recorded:
                    _local_train_step(
                        loss_fn, tx, axis_name, has_aux, local_view(state), batch, True, blocks
                    )
                return ensure_varying(recorded.as_array(), axis_name)[None]
            new, metrics = _local_train_step(
                loss_fn, tx, axis_name, has_aux, local_view(state), batch, True, blocks
            )
            if blocks is None:
                return global_view(new), metrics
            return TrainState(new.params, global_view(new.opt_state)), metrics

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, _split_batch_spec(axis_name, batch)),
            out_specs=P(axis_name) if probe else (specs, P()),
            check_vma=check_vma,
        )
        return mapped(state, batch)

    donate_argnums = (0,) if donate else ()
    if specialize_phases:
        probe = functools.partial(global_step, probe=True)
        program = PhasedStep(global_step, probe, donate_argnums=donate_argnums)
    else:
        program = jax.jit(global_step, donate_argnums=donate_argnums)
    place = functools.partial(place_batch, mesh=mesh, axis_name=axis_name)
    return TrainStep(program, place, max_in_flight=max_in_flight), state


def _owned(tree: PyTree) -> PyTree:
    """Fresh copies, so that donating the train state never deletes the caller's arrays
    (``device_put`` may alias its input even with ``may_alias=False``)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def make_pmap_train_step(
    axis_name: str,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    params: PyTree,
    *,
    devices: Sequence[jax.Device] | None = None,
    has_aux: bool = False,
    donate: bool = True,
    specialize_phases: bool = True,
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
) -> tuple[Callable, TrainState]:
    """The ``jax.pmap`` variant of :func:`make_train_step`.

    The state is in the pmap layout (every leaf stacked ``(n, ...)``; :func:`from_pmap_layout`
    turns it into the global layout, e.g. to compare or checkpoint interchangeably).
    ``step(state, batch)`` takes the same global batch as the ``shard_map`` step (split into
    ``n`` equal parts on its leading axis) and returns ``(state, metrics)``, metrics unstacked.
    ``step.pmapped`` is the underlying ``pmap`` function (batch already ``(n, b, ...)``);
    with ``specialize_phases`` (as :func:`make_train_step`'s: one ``pmap`` per phase, chosen on
    the host) it is the :class:`jaxcomm.phases.PhasedStep`, and ``step.phased`` too.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    opt_state = jax.jit(init_opt_state, static_argnums=(0, 2, 3))(tx, params, axis_name, n)
    stacked_params = jax.tree.map(lambda p: jnp.broadcast_to(p[None], (n, *jnp.shape(p))), params)
    state = _owned(TrainState(stacked_params, opt_state))  # pmap places rows on first call

    def body(state, batch):
        return _local_train_step(loss_fn, tx, axis_name, has_aux, state, batch, varying=False)

    def probe(state, batch):  # the phases only: the step itself is dead code
        with record_phases() as recorded:
            body(state, batch)
        return recorded.as_array()

    def compile_pmap(fn, donate_argnums=(), out_axes=(0, None)):
        return jax.pmap(
            fn,
            axis_name=axis_name,
            devices=devices,
            out_axes=out_axes,
            donate_argnums=donate_argnums,
        )

    donate_argnums = (0,) if donate else ()
    if specialize_phases:
        pmapped = PhasedStep(
            body,
            probe,
            donate_argnums=donate_argnums,
            compile=compile_pmap,
            compile_probe=functools.partial(compile_pmap, out_axes=0),
        )
    else:
        pmapped = compile_pmap(body, donate_argnums)

    def split(batch):
        def rows(path, x):
            shape = jnp.shape(x)
            if not shape or shape[0] % n:
                raise ValueError(
                    f"jaxcomm: batch leaf {jax.tree_util.keystr(path) or 'the batch'} has shape "
                    f"{tuple(shape)}: its leading dimension must split evenly over {n} devices "
                    f"(pass a multiple of {n} rows)"
                )
            return jnp.reshape(x, (n, -1, *shape[1:]))

        return jax.tree_util.tree_map_with_path(rows, batch)

    step = TrainStep(pmapped, split, max_in_flight=max_in_flight)
    step.pmapped = pmapped
    return step, state
