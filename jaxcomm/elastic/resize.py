"""Moving per-device error feedback onto a different number of devices (elastic restarts).

A checkpoint saved on ``n`` devices holds ``n`` error-feedback states whose shapes depend on
``n`` (1-bit pads to ``8n``, server residuals are cut into ``n`` chunks, reduce-scatter rows
are ``ceil(numel / n)`` long). Restored as-is onto ``m != n`` devices, the collectives refuse it
at trace time (the state check names the axis size). :func:`resize_state` converts it.

What is preserved. The error feedback is gradient information not yet transmitted. For every
bucket of ``N`` elements, its **pending sum** is the vector ``T`` (in the bucket's real,
unpadded coordinates, in the units of ``compressed_psum``) such that, over any run of steps
with inputs ``x_t`` on each device,

    ``sum_t psum_output_t == sum_t sum_r x_{t,r} + T_start - T_end``.

The compressor owns its state's layout: ``compressor.pending_sum(states, bucket, op)`` computes
``T`` from the old devices' states, and ``compressor.with_pending(T / m, ...)`` builds each of
the ``m`` new devices' states around its share (``jc.Compressor`` documents both; the two-stage
compressors put it in the worker residual and start the server residual at zero), so ``T`` is
exactly preserved (up to fp32 rounding) and the identity above holds across the restart. With
``compressed_pmean`` this means the untransmitted gradients keep their weight in the *sum*: as
each device's gradient now counts ``1/m`` of the mean, so does theirs. A compressor whose
``pending_sum`` is ``None``, or ``reset=True``, gives zeros with a ``UserWarning`` saying what
was dropped. The non-finite counter of every new device is the largest old one.

The state is in the global layout (``(n, *local)`` per leaf: ``jc.stack_per_device``'s, the one
:mod:`jaxcomm.train.layout`, ``shard_map`` with ``P(axis)`` and ``pmap`` use). Everything runs on
the host, in NumPy.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from jaxcomm.comm.state import STATE_TYPES, init_state, plan_tree
from jaxcomm.compressors import Compressor

PyTree = Any


def _split(state: PyTree, n: int) -> list[PyTree]:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape = np.shape(leaf)
        if not shape or shape[0] != n:
            raise ValueError(
                f"jaxcomm: resize_state: state leaf {jax.tree_util.keystr(path)} has global shape "
                f"{shape}, which is not {n} per-device states stacked (n, *local) (was it saved "
                "with another axis_size? build the global state with jc.stack_per_device)"
            )
    return [jax.tree.map(lambda x, r=r: np.asarray(x)[r], state) for r in range(n)]


def _join(states: list[PyTree]) -> PyTree:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)


def _check(states: list[PyTree], expected: PyTree, n: int) -> None:
    want = [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(expected)]
    want_struct = jax.tree.structure(expected)
    for r, s in enumerate(states):
        if jax.tree.structure(s) != want_struct:
            raise ValueError(
                f"jaxcomm: resize_state: device {r}'s state has structure "
                f"{jax.tree.structure(s)}, expected {want_struct} for this tree, compressor and "
                f"bucket_bytes on {n} devices"
            )
        for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(s), want, strict=True):
            if (tuple(np.shape(got)), np.asarray(got).dtype) != w:
                raise ValueError(
                    f"jaxcomm: resize_state: state leaf {jax.tree_util.keystr(path)} has "
                    f"per-device shape {np.shape(got)} {np.asarray(got).dtype}, expected "
                    f"{w[0]} {w[1]} for this tree, compressor and bucket_bytes on {n} devices "
                    "(was it saved with another axis_size, tree or bucket_bytes?)"
                )


def resize_state(
    state: PyTree,
    compressor: Compressor,
    tree: PyTree,
    *,
    axis_size: int,
    new_axis_size: int,
    bucket_bytes: int | None = None,
    op: str = "all_reduce",
    reset: bool = False,
) -> PyTree:
    """Convert the error feedback of ``axis_size`` devices into that of ``new_axis_size``.

    Args:
      state: the global ``jc.ReduceState`` / ``jc.ScatterState`` of ``axis_size`` devices (as
        saved: host or device arrays), every leaf ``(axis_size, *local)``.
      compressor, tree, bucket_bytes, op: as given to :func:`jaxcomm.init_state`.
      axis_size: devices the state was saved on.
      new_axis_size: devices it will run on.
      reset: drop the error feedback instead (zeros, with a warning).

    Returns:
      The state for ``new_axis_size`` devices, every leaf ``(new_axis_size, *local)`` (NumPy
      arrays), whose pending sum (module docstring) equals the old one. Raises ``ValueError``
      if ``state`` does not fit ``tree``/``compressor``/``bucket_bytes``/``op`` on
      ``axis_size`` devices.
    """
    for name, value in (("axis_size", axis_size), ("new_axis_size", new_axis_size)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"jaxcomm: {name} must be a positive int, got {value!r}")
    n, m = int(axis_size), int(new_axis_size)
    if state is None:
        return None
    old_template = init_state(compressor, tree, axis_size=n, bucket_bytes=bucket_bytes, op=op)
    new_template = init_state(compressor, tree, axis_size=m, bucket_bytes=bucket_bytes, op=op)
    if type(state) is not STATE_TYPES[op]:
        raise ValueError(
            f"jaxcomm: resize_state: got a {type(state).__name__}, expected "
            f"{STATE_TYPES[op].__name__} for op={op!r}"
        )
    states = _split(state, n)
    _check(states, old_template, n)
    if not jax.tree.leaves(new_template):
        return new_template  # nothing per device
    _, _, buckets = plan_tree(tree, compressor, bucket_bytes)
    new_buckets: list[list[Any]] = [[] for _ in range(m)]
    dropped = []
    for k, bucket in enumerate(buckets):
        old = [s.buckets[k] for s in states]
        template = jax.tree.map(np.asarray, new_template.buckets[k])
        stateful = bool(jax.tree.leaves(template))
        total = compressor.pending_sum(old, bucket, op) if stateful and not reset else None
        if total is None and stateful:
            dropped.append(f"bucket {k} ({type(template).__name__})")
        for r in range(m):
            if total is None:
                new_buckets[r].append(template)
                continue
            share = (total / m).astype(np.float32)
            state_r = compressor.with_pending(share, template, bucket, op, axis_size=m, old=old)
            new_buckets[r].append(state_r)
    if dropped:
        name = type(compressor).__name__
        why = "reset=True" if reset else f"no known layout: {name}.pending_sum is None"
        warnings.warn(
            f"jaxcomm: resize_state from {n} to {m} devices reset the error feedback of "
            f"{', '.join(dropped)} ({why}): its untransmitted gradient information is lost",
            UserWarning,
            stacklevel=2,
        )
    counter = max(int(np.max(np.asarray(s.nonfinite))) for s in states)
    new_states = [
        type(state)(
            tuple(new_buckets[r]), np.full(np.shape(new_template.nonfinite), counter, np.int32)
        )
        for r in range(m)
    ]
    return _join(new_states)


def merge_rows(rows: np.ndarray, m: int, *, accumulate=None) -> np.ndarray:
    """Per-device rows ``(n, ...)`` -> ``m`` copies of their mean (floating leaves; computed in
    ``accumulate``, default the rows' own dtype) or of their maximum (integer and bool leaves)."""
    if np.issubdtype(rows.dtype, np.inexact):
        merged = rows.astype(accumulate or rows.dtype).mean(axis=0).astype(rows.dtype)
    else:
        merged = rows.max(axis=0)
    return np.broadcast_to(merged[None], (m, *merged.shape)).copy()
