"""Error-feedback state of the collectives: its types, construction, validation, the guard.

State. :func:`init_state` builds one device's error-feedback state for its local tree. The global
layout, the same for ``shard_map``, ``pmap`` and the optimizers' states
(:mod:`jaxcomm.train.layout`), stacks the devices' states on a new leading axis: every leaf is
``(n, *local_shape)``, built from one device's state by ``jc.stack_per_device(state, n)``, and
passed with ``in_specs``/``out_specs`` ``P(axis_name)`` (``pmap``: leading axis mapped). Inside
``shard_map`` a collective then receives ``(1, *local_shape)`` blocks and returns the new state
in the same shape (:func:`as_local_block`). The state's bucket layout depends on the tree, the
axis size and ``bucket_bytes``; :func:`check_state` refuses a state built for anything else in
one sentence naming the mismatch.

Non-finite input. A NaN or Inf gradient makes the output non-finite (so loss scaling or
skip-step logic sees it), but it never reaches the error feedback: a bucket whose compressed
output or new error state is not finite keeps its previous (finite) state, and the call is
counted in the state's ``nonfinite`` counter (per device, int32 ``(1,)``); see :func:`keep_finite`.

Per-device types. A state type whose leaves differ per device marks itself with
:func:`per_device` where it is defined; :mod:`jaxcomm.train.layout` asks :func:`is_per_device`
and imports no optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.comm.axes import level_sizes
from jaxcomm.comm.two_level import share_bucket
from jaxcomm.compressors import Compressor
from jaxcomm.compressors.buckets import Bucket, check_leaves, plan_buckets

PyTree = Any
StateOp = Literal["all_reduce", "reduce_scatter"]

# -- per-device registry ---------------------------------------------------------------------

_PER_DEVICE: list[type] = []
_PER_DEVICE_PARAMS: list[type] = []


def per_device(cls: type | None = None, *, params: bool = False, _blocks: bool = False):
    """Class decorator: values of this (``NamedTuple``) type are private to each device.

    ``@per_device``: the node's leaves are per-device (error feedback, local moments): they are
    sharded over the data axis by :func:`jaxcomm.state_partition_specs`. ``@per_device(params=
    True)``: the optimizer state also keeps the parameters per device between syncs (0/1 Adam's
    local steps), so the train state's params are per-device too.
    """
    # Private hook (_blocks): jaxcomm.train.layout.local_view leaves the type's (1, *local)
    # blocks as they are (its code reads either layout), so XLA:CPU updates them in place.

    def mark(c: type) -> type:
        registry = _PER_DEVICE_PARAMS if params else _PER_DEVICE
        if c not in registry:
            registry.append(c)
        if _blocks:
            setattr(c, "_keeps_blocks", True)  # noqa: B010 (NamedTuple bodies take only fields)
        return c

    return mark if cls is None else mark(cls)


def register_per_device_type(cls: type, *, params_per_device: bool = False) -> None:
    """Function form of :func:`per_device` (for types defined outside jaxcomm)."""
    per_device(cls, params=params_per_device)


def per_device_types(*, params: bool = False) -> tuple[type, ...]:
    """The registered per-device types (``params=True``: those with per-device params)."""
    return tuple(_PER_DEVICE_PARAMS if params else _PER_DEVICE)


def is_per_device(node: Any) -> bool:
    """True for a node of a registered per-device type."""
    return isinstance(node, tuple(_PER_DEVICE))


def holds_per_device_params(node: Any) -> bool:
    """True for a node of a type registered with ``params=True``."""
    return isinstance(node, tuple(_PER_DEVICE_PARAMS))


# -- state types -----------------------------------------------------------------------------


@per_device(_blocks=True)
class ReduceState(NamedTuple):
    """Error feedback of :func:`compressed_psum` / :func:`compressed_pmean`, one per bucket.

    Attributes:
      buckets: one compressor state per bucket.
      nonfinite: int32 ``(1,)``: calls whose output or new state was not finite, so the
        bucket states were kept unchanged (``()`` when no bucket has error feedback).
    """

    buckets: tuple
    nonfinite: Any = ()


@per_device(_blocks=True)
class ScatterState(NamedTuple):
    """Error feedback of :func:`compressed_psum_scatter`, one entry per bucket; ``nonfinite``
    as in :class:`ReduceState`."""

    buckets: tuple
    nonfinite: Any = ()


#: The state type of each op.
STATE_TYPES = {"all_reduce": ReduceState, "reduce_scatter": ScatterState}


def check_compressor(compressor: Any) -> Compressor:
    """``compressor`` if it is a jaxcomm :class:`Compressor`, else a clear ``TypeError``."""
    if isinstance(compressor, type):
        raise TypeError(
            f"jaxcomm: compressor must be a compressor instance, got the class "
            f"{compressor.__name__}: write {compressor.__name__}(...)"
        )
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"jaxcomm: compressor must be a jaxcomm Compressor (e.g. jc.OneBit()), "
            f"got {compressor!r}"
        )
    return compressor


def plan_tree(tree: PyTree, compressor: Compressor, bucket_bytes: int | None):
    """``(leaves, treedef, buckets)`` of ``tree`` for ``compressor`` (static, at trace time).

    A leaf jaxcomm cannot reduce is named by its path in ``tree`` (``['enc']['scale']``).
    """
    check_compressor(compressor)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_paths]
    check_leaves(leaves, [jax.tree_util.keystr(path) or "(the root)" for path, _ in with_paths])
    return leaves, treedef, plan_buckets(leaves, bucket_bytes, compressor.compute_dtype)


def _bucket_state(compressor: Compressor, bucket: Bucket, axis_size, op: StateOp):
    if bucket.exact or bucket.numel == 0:
        return ()
    if isinstance(axis_size, tuple):  # two-level: the error feedback of this device's share
        slow, fast = level_sizes(axis_size)
        return compressor.init_bucket_state(share_bucket(bucket, slow, fast, op), slow, op)
    return compressor.init_bucket_state(bucket, axis_size, op)


def check_axis_size(axis_size) -> int | tuple[int, ...]:
    """``axis_size`` as a positive int, or a tuple of them for several axes (slowest first; a
    one-element tuple is its int), else a clear error."""

    def positive(v) -> bool:
        return bool(isinstance(v, int | np.integer) and not isinstance(v, bool) and v >= 1)

    if isinstance(axis_size, tuple | list) and axis_size and all(positive(v) for v in axis_size):
        sizes = tuple(int(v) for v in axis_size)
        return sizes[0] if len(sizes) == 1 else sizes
    if positive(axis_size):
        return int(axis_size)
    raise ValueError(
        "jaxcomm: axis_size must be a positive int, or a tuple of them for a tuple of axes "
        f"(slowest first), got {axis_size!r}"
    )


def new_state(compressor: Compressor, buckets, axis_size, op: StateOp):
    """A zero state for ``buckets`` (the planned buckets of a tree); ``axis_size`` is an int,
    or the axes' sizes for a tuple of axes (the two-level transport)."""
    states = tuple(_bucket_state(compressor, b, axis_size, op) for b in buckets)
    # The non-finite counter exists only where there is error feedback to protect, so exact
    # compressors keep a leafless state (and accept None).
    counter = jnp.zeros((1,), jnp.int32) if jax.tree_util.tree_leaves(states) else ()
    return STATE_TYPES[op](states, counter)


def init_state(
    compressor: Compressor,
    tree: PyTree,
    *,
    axis_size: int | tuple[int, ...],
    bucket_bytes: int | None = None,
    op: StateOp = "all_reduce",
) -> ReduceState | ScatterState:
    """One device's error-feedback state for reducing its local ``tree`` over ``axis_size`` devices.

    Args:
      compressor: the compressor the state is for.
      tree: the local tree (arrays or ``jax.ShapeDtypeStruct``s); only shapes and dtypes are read.
      axis_size: number of devices on the reduced axis; for a tuple of axes (slowest first, the
        two-level transport of :mod:`jaxcomm.comm.two_level`) the tuple of their sizes, e.g.
        ``(2, 4)`` for ``("host", "local")``: each device then keeps the error feedback of its
        ``1/4`` share of every bucket.
      bucket_bytes: the bucket size the collective will be called with.
      op: ``"all_reduce"`` for ``compressed_psum``/``compressed_pmean``, ``"reduce_scatter"`` for
        ``compressed_psum_scatter``. (All-gathers carry no error feedback.)

    Returns:
      A ``ReduceState`` or ``ScatterState``; all leaves fp32 zeros of rank 1 (none for exact
      compressors).

    Examples:
      >>> import jax, jaxcomm as jc
      >>> state = jc.init_state(jc.OneBit(), {"w": jax.numpy.zeros((3, 5))}, axis_size=4)
      >>> [x.shape for x in jax.tree.leaves(state)]  # worker, server error, nonfinite counter
      [(32,), (8,), (1,)]
    """
    if op not in STATE_TYPES:
        raise ValueError(f"jaxcomm: op must be 'all_reduce' or 'reduce_scatter', got {op!r}")
    axis_size = check_axis_size(axis_size)
    _, _, buckets = plan_tree(tree, compressor, bucket_bytes)
    return new_state(compressor, buckets, axis_size, op)


def check_state(state, compressor, buckets, axis_name, axis_size, op: StateOp, bucket_bytes):
    """Refuse, at trace time, a state that was built for another tree, axis or bucket size.

    Returns the state to use: ``state``, or a leafless one when ``state`` is ``None`` and the
    call needs none.
    """
    state_type = STATE_TYPES[op]
    expected = jax.eval_shape(lambda: new_state(compressor, buckets, axis_size, op))
    if state is None and not jax.tree_util.tree_leaves(expected):
        return expected  # stateless (NoCompression, or only exact leaves): None is accepted
    other = {v: k for k, v in STATE_TYPES.items()}
    if type(state) in other and type(state) is not state_type:
        raise ValueError(
            f"jaxcomm: this state was built for {other[type(state)]!r} collectives; build one with "
            f"jc.init_state(compressor, tree, axis_size=n, op={op!r})"
        )
    build = (
        f"jc.init_state(compressor, tree, axis_size={axis_size}, bucket_bytes={bucket_bytes}"
        + (f", op={op!r})" if op != "all_reduce" else ")")
    )
    if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(expected):
        raise ValueError(_structure_mismatch(state, expected, compressor, bucket_bytes, build))
    for path_got, want in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(expected), strict=True
    ):
        path, got = path_got
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            hint = "Was the state built for another tree, axis size or compressor? Build it with "
            hint += build + "."
            total = math.prod(axis_size) if isinstance(axis_size, tuple) else axis_size
            if _all_devices_states(state, expected, total):
                # Every device sees all n devices' states: passed with P() instead of P(axis).
                hint = (
                    f"It holds all {total} devices' states: pass the global state "
                    f"(jc.stack_per_device(state, {total})) with in_specs and out_specs "
                    f"P({axis_name!r}), so that each device receives its own."
                )
            raise ValueError(
                f"jaxcomm: state leaf {jax.tree_util.keystr(path)} has per-device shape "
                f"{tuple(got.shape)} {np.dtype(got.dtype)}, this call (axis {axis_name!r} of "
                f"size {axis_size}, {compressor!r}) needs {tuple(want.shape)} "
                f"{np.dtype(want.dtype)}. {hint}"
            )
    return state


def _all_devices_states(state, expected, axis_size: int) -> bool:
    """Every leaf is ``axis_size`` local leaves concatenated: the global state passed as P()."""
    return all(
        len(g.shape) == len(w.shape) >= 1
        and g.shape[0] == axis_size * w.shape[0]
        and tuple(g.shape[1:]) == tuple(w.shape[1:])
        for g, w in zip(
            jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(expected), strict=True
        )
    )


def _kind(node) -> str:
    """A short name for a state node: its type, or what it holds."""
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return "no state" if not node else f"a tuple of {len(node)}"
    return type(node).__name__


def _structure_mismatch(state, expected, compressor, bucket_bytes, build: str) -> str:
    """One sentence on how ``state`` differs from the state this call needs (no tree dumps)."""
    if state is None:
        return (
            f"jaxcomm: this call needs a state (compressor {compressor!r} keeps error feedback): "
            f"pass the {type(expected).__name__} built by {build}, got None"
        )
    if not isinstance(state, ReduceState | ScatterState):
        return (
            f"jaxcomm: the state must be the {type(expected).__name__} built by {build}, got "
            f"{_kind(state)}"
        )
    got, want = len(state.buckets), len(expected.buckets)
    if got != want:
        return (
            f"jaxcomm: the state has {got} bucket{'s' if got != 1 else ''}, this call has {want} "
            f"(bucket_bytes={bucket_bytes}): build the state with the same bucket_bytes, "
            f"{build}."
        )
    for i, (g, w) in enumerate(zip(state.buckets, expected.buckets, strict=True)):
        if jax.tree_util.tree_structure(g) != jax.tree_util.tree_structure(w):
            return (
                f"jaxcomm: bucket {i} of the state holds {_kind(g)}, but this call's compressor "
                f"{compressor!r} needs {_kind(w)}: build the state with the same compressor "
                f"(and tree), {build}."
            )
    return (
        f"jaxcomm: the state's non-finite counter is {_kind(state.nonfinite)}, this call needs "
        f"{_kind(expected.nonfinite)}: build the state with {build}."
    )


def as_local_block(state, compressor, buckets, axis_size, op: StateOp):
    """``(this device's state, restore)`` for a state in the stacked global layout.

    Under ``shard_map`` with ``P(axis)`` a state stacked ``(n, *local)`` (``jc.stack_per_device``)
    arrives as ``(1, *local)`` blocks: they are squeezed here and ``restore`` puts the leading
    axis back on the new state. Any other state (local shapes: ``pmap``, or one built inside the
    mapped function; or one that does not fit, which :func:`check_state` then refuses) passes
    unchanged.
    """
    leaves = jax.tree_util.tree_leaves(state)
    if not leaves:
        return state, lambda s: s
    expected = jax.eval_shape(lambda: new_state(compressor, buckets, axis_size, op))
    want = jax.tree_util.tree_leaves(expected)
    if jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(expected) and all(
        tuple(np.shape(g)) == (1, *w.shape) for g, w in zip(leaves, want, strict=True)
    ):
        return jax.tree.map(lambda x: x[0], state), lambda s: jax.tree.map(lambda x: x[None], s)
    return state, lambda s: s


# -- the non-finite guard --------------------------------------------------------------------


def keep_finite(state, new_states, finites):
    """The new state, with ``nonfinite`` counting the call if any bucket was not finite.

    Each compressed bucket has already kept its previous state when its own output or new
    state was not finite (:meth:`Compressor.guarded_all_reduce_bucket`, decided from its
    :meth:`Compressor.finite_probe` or, for OneBit, from the scales before the residuals are
    written, so the guard costs no pass of its own, only OneBit's read of the old worker
    residual in the select that keeps it); ``finites`` are those buckets' flags
    (bool scalars). Buckets are guarded independently, so their chains stay independent: a
    NaN in one bucket's leaves leaves the other buckets' error feedback moving. Under normal
    propagation a non-finite input on any device makes that bucket's (replicated) all-reduce
    output non-finite everywhere, so all devices keep that bucket's state together.
    """
    # A stateless call (state=None) returns None, so users can keep passing None.
    if state is None:
        return None
    new_states = tuple(new_states)
    if not jax.tree_util.tree_leaves(state.buckets) or not finites:
        return type(state)(new_states, state.nonfinite)
    bad = jnp.bool_(False)
    for finite in finites:
        bad = bad | ~finite
    return type(state)(new_states, state.nonfinite + bad.astype(jnp.int32))
