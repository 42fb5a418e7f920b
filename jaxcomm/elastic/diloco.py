"""DiLoCo's state on another device count (elastic restarts): :func:`resize_diloco_state`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxcomm.compressors import Compressor
from jaxcomm.elastic.resize import merge_rows, resize_state
from jaxcomm.optim.diloco.state import (
    DiLoCoState,
    check_compressor,
    check_int,
    find_diloco,
    fragment_leaves,
)
from jaxcomm.train.layout import TrainState

PyTree = Any


def resize_diloco_state(
    state: TrainState,
    compressor: Compressor | None,
    *,
    new_axis_size: int,
    bucket_bytes: int | None = None,
) -> TrainState:
    """A DiLoCo :class:`jaxcomm.TrainState` of ``n`` devices, converted for ``new_axis_size``.

    ``state`` is in :mod:`jaxcomm.train.layout`'s global layout (per-device leaves stacked
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

    With ``background=True``, a sync in flight (a state between the step that issues it and
    the one that merges it) lives in the per-device pending pseudo-gradients, which are
    averaged like the local copies: the first step on the new devices reissues the sync from
    them, so it reduces their mean (the exact mean: the outer gradient the ``n`` devices were
    reducing, within fp32 rounding; a compressed one: that mean re-encoded by the ``m``
    devices with the resized error feedback).
    """
    compressor = check_compressor(compressor)
    m = check_int("new_axis_size", new_axis_size, 1)
    old = find_diloco(state.opt_state)
    n = int(old.devices.shape[0])

    def regrid(x):
        return merge_rows(np.asarray(x), m)

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
    return TrainState(jax.tree.map(regrid, state.params), opt_state)
