"""DiLoCo's state: its types, the fragment schedule, and reading or converting a state.

:func:`jaxcomm.diloco` (:mod:`jaxcomm.optim.diloco`, the algorithm) keeps a
:class:`DiLoCoState`; this module defines it and what reads a state from outside the
training step: :func:`diloco_params` (the outer parameters, the model to evaluate;
``jc.resize_diloco_state``, in :mod:`jaxcomm.elastic.diloco`, converts it for another device
count). Fragment ``f``
of ``F`` holds the leaves ``i % F == f`` and syncs after the steps ``t % H == o_f``
(:func:`fragment_leaves`, :func:`fragment_offsets`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxcomm.comm.state import check_compressor as comm_check_compressor
from jaxcomm.comm.state import per_device
from jaxcomm.compressors import Compressor, NoCompression
from jaxcomm.guard import SkipCounters

PyTree = Any


@per_device(_blocks=True)  # private to each device
class DiLoCoLocal(NamedTuple):
    """DiLoCo's per-device leaves besides the parameters (inside ``jc.local_view`` every leaf
    is a ``(1, *shape)`` block, which :func:`jaxcomm.diloco` updates in place, running the inner
    optimizer under ``vmap``).

    Attributes:
      inner: the inner optimizer's state (its moments come from this device's gradients).
      skips: the inner steps skipped on this device because its gradient was not finite, in
        a row and in all (:class:`~jaxcomm.guard.SkipCounters`, int32 scalars);
        ``max_consecutive_skips`` bounds the steps in a row.
      pending: with ``background=True``, per fragment, this device's pseudo-gradient
        ``theta_f - x_f`` of its latest sync (fp32 leaves), which the host side computes
        before step ``t_s + 1`` and reduces while the steps pass it on; ``()`` otherwise.
    """

    inner: PyTree
    skips: SkipCounters
    pending: tuple = ()


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
      skips: the outer steps skipped because the outer gradient or the new outer parameters
        were not finite, in a row and in all (:class:`~jaxcomm.guard.SkipCounters`, int32
        scalars); ``max_consecutive_skips`` bounds the steps in a row.
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
    skips: SkipCounters
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
    """``compressor``, ``None`` meaning the exact mean (:class:`NoCompression`)."""
    if compressor is None:
        return NoCompression()
    if not isinstance(compressor, Compressor | type):
        raise TypeError(
            "jaxcomm: diloco compressor must be None (exact mean) or a jaxcomm Compressor that "
            "all-reduces (jc.Quantize(bits=4, error_feedback=True), jc.OneBit(), jc.TopK(...), "
            f"...), got {compressor!r}"
        )
    return comm_check_compressor(compressor)


def find_diloco(opt_state: PyTree) -> DiLoCoState:
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
    return find_diloco(opt_state).outer_params
