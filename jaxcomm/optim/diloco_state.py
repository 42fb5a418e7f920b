"""DiLoCo's state: its types, the fragment schedule, and reading or converting a state.

:func:`jaxcomm.diloco` (:mod:`jaxcomm.optim.diloco`, the algorithm) keeps a
:class:`DiLoCoState`; this module defines it and what works on a state from outside the
training step: :func:`diloco_params` (the outer parameters, the model to evaluate) and
:func:`resize_diloco_state` (a state of ``n`` devices for ``m``, on the host). Fragment ``f``
of ``F`` holds the leaves ``i % F == f`` and syncs after the steps ``t % H == o_f``
(:func:`fragment_leaves`, :func:`fragment_offsets`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxcomm import parallel
from jaxcomm.comm.state import per_device
from jaxcomm.compressors import Compressor, NoCompression

PyTree = Any


@per_device(blocks=True)  # private to each device; (1, ...) blocks inside jc.local_view
class DiLoCoLocal(NamedTuple):
    """DiLoCo's per-device leaves besides the parameters (inside ``jc.local_view`` every leaf
    is a ``(1, *shape)`` block, which :func:`jaxcomm.diloco` updates in place, running the inner
    optimizer under ``vmap``).

    Attributes:
      inner: the inner optimizer's state (its moments come from this device's gradients).
      nonfinite: int32 scalar: inner steps skipped on this device because its new local
        parameters were not finite.
      consecutive: int32 scalar: of those, how many in a row up to now (0 after a step that
        was taken); ``max_consecutive_skips`` bounds it.
    """

    inner: PyTree
    nonfinite: jax.Array
    consecutive: jax.Array


@per_device(params=True)  # a DiLoCoState means the parameters are per device
class DiLoCoState(NamedTuple):
    """State of :func:`diloco`. Everything but ``local`` and ``comm`` is replicated.

    Attributes:
      count: steps done so far (int32 scalar).
      outer_params: ``theta``, the outer (global) parameters, fp32, structured like the
        parameters; the model to evaluate (:func:`diloco_params`).
      outer: one outer-optimizer state per fragment (each over the fragment's list of leaves).
      inflight: per fragment, the reduced outer gradient waiting to be merged (a list of fp32
        leaves), or ``()`` when ``overlap_steps == 0``.
      skipped: int32 scalar: outer steps skipped because the outer gradient was not finite.
      consecutive: int32 scalar: of those, how many in a row up to now (0 after an outer step
        that was taken); ``max_consecutive_skips`` bounds it.
      devices: int8 zeros ``(n,)``: records the number of devices the per-device leaves were
        built for (checked at trace time; use :func:`resize_diloco_state` to change it).
      local: per-device :class:`DiLoCoLocal` (the inner optimizer state).
      comm: per fragment, the error feedback of the outer-gradient all-reduce
        (per-device ``jc.ReduceState``; leafless for exact reductions).
    """

    count: jax.Array
    outer_params: PyTree
    outer: tuple
    inflight: tuple
    skipped: jax.Array
    consecutive: jax.Array
    devices: jax.Array
    local: DiLoCoLocal
    comm: tuple


def fragment_offsets(sync_every: int, fragments: int) -> tuple[int, ...]:
    """``o_f = ((f + 1) H // F) % H``: fragment ``f`` syncs after the steps ``t % H == o_f``."""
    return tuple(((f + 1) * sync_every // fragments) % sync_every for f in range(fragments))


def fragment_leaves(num_leaves: int, fragments: int) -> tuple[tuple[int, ...], ...]:
    """Leaf indices of each fragment: leaf ``i`` (tree order) belongs to fragment ``i % F``."""
    return tuple(tuple(range(f, num_leaves, fragments)) for f in range(fragments))


def check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"jaxcomm: diloco {name} must be an int >= {low}, got {value!r}")
    return int(value)


def check_compressor(compressor) -> Compressor:
    if compressor is None:
        return NoCompression()
    if isinstance(compressor, type):
        raise TypeError(
            f"jaxcomm: diloco compressor must be a compressor instance, got the class "
            f"{compressor.__name__}: write {compressor.__name__}(...)"
        )
    if not isinstance(compressor, Compressor):
        raise TypeError(
            "jaxcomm: diloco compressor must be None (exact mean) or a jaxcomm Compressor that "
            "all-reduces (jc.Quantize(bits=4, error_feedback=True), jc.OneBit(), jc.TopK(...), "
            f"...), got {compressor!r}"
        )
    return compressor


def _find_diloco(opt_state: PyTree) -> DiLoCoState:
    found = []

    def visit(node):
        if isinstance(node, DiLoCoState):
            found.append(node)
        return node

    jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))
    if len(found) != 1:
        raise ValueError(
            f"jaxcomm: expected one DiLoCoState in the optimizer state, found {len(found)}"
        )
    return found[0]


def diloco_params(opt_state: PyTree) -> PyTree:
    """``theta``, the outer parameters (fp32) of the :class:`DiLoCoState` in ``opt_state``: the
    model DiLoCo trains, to evaluate or export (identical on every device)."""
    return _find_diloco(opt_state).outer_params


def resize_diloco_state(
    state: parallel.TrainState,
    compressor: Compressor | None,
    *,
    new_axis_size: int,
    bucket_bytes: int | None = None,
) -> parallel.TrainState:
    """A DiLoCo :class:`jaxcomm.TrainState` of ``n`` devices, converted for ``new_axis_size``.

    ``state`` is in :mod:`jaxcomm.parallel`'s global layout (per-device leaves stacked
    ``(n, ...)``), with a :class:`DiLoCoState` as (or anywhere in) its optimizer state. The new
    devices all start from the **average** of the ``n`` local parameter copies and of the
    ``n`` inner states (floating leaves; integer leaves, step and non-finite counts: their
    maximum), as if the interval's local progress were averaged without an outer step;
    ``theta``, the outer
    states and any in-flight outer gradient are replicated and kept. The error feedback of
    every fragment goes through :func:`jaxcomm.resize_state` and is scaled by ``m / n``: the
    untransmitted part of the *mean* outer gradient, ``T / n`` (``T`` the pending sum), is kept,
    as :func:`jaxcomm.reshard_train_state` does. Runs on the host (NumPy). ``compressor``
    and ``bucket_bytes`` as given to :func:`diloco`.
    """
    from jaxcomm.resize import resize_state  # host-side tool; keep it off the import path

    compressor = check_compressor(compressor)
    m = check_int("new_axis_size", new_axis_size, 1)
    old = _find_diloco(state.opt_state)
    n = int(old.devices.shape[0])

    def regrid(x):
        x = np.asarray(x)
        row = x.mean(axis=0).astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else x.max(0)
        return np.broadcast_to(row[None], (m, *row.shape)).copy()

    theta_leaves = jax.tree.leaves(old.outer_params)
    groups = fragment_leaves(len(theta_leaves), len(old.comm))
    comm = []
    for c, ids in zip(old.comm, groups, strict=True):
        tree = [theta_leaves[i] for i in ids]
        c = resize_state(
            c, compressor, tree, axis_size=n, new_axis_size=m, bucket_bytes=bucket_bytes
        )
        # resize_state keeps the pending sum T; the outer gradient is a mean, so keep its
        # pending share T / n instead: T -> T m / n (the state is linear in T).
        comm.append(
            jax.tree.map(
                lambda x: (
                    (x * (m / n)).astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else x
                ),
                c,
            )
        )
    comm = tuple(comm)
    new = old._replace(
        devices=np.zeros((m,), np.int8),
        local=jax.tree.map(regrid, old.local),
        comm=comm,
    )
    opt_state = jax.tree.map(
        lambda node: new if node is old else node,
        state.opt_state,
        is_leaf=lambda x: isinstance(x, DiLoCoState),
    )
    return parallel.TrainState(jax.tree.map(regrid, state.params), opt_state)
