"""Placing a global batch on a mesh: every leaf's leading axis split over the data axis."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm.axes import AxisName, axis_names, canonical_axis, mesh_axis_size

PyTree = Any


@functools.cache  # called per batch leaf and step: scan the mesh once
def _devices_here(mesh: Mesh, axis_name) -> int:
    """How many slices of ``axis_name`` this process's devices hold (all of them, one process)."""
    names = axis_names(axis_name)
    axes = [mesh.axis_names.index(a) for a in names]
    pid = jax.process_index()
    rows = {
        tuple(idx[a] for a in axes)
        for idx, device in np.ndenumerate(mesh.devices)
        if device.process_index == pid
    }
    return len(rows)


def place_batch(batch: PyTree, mesh: Mesh, axis_name: AxisName) -> PyTree:
    """``batch`` with every leaf split on its leading axis over ``axis_name`` of ``mesh``.

    A ``jax.Array`` already split that way is returned as it is; another ``jax.Array`` is
    moved with ``jax.device_put``. Host data (NumPy arrays, lists, scalars with a leading axis)
    is this process's part of the global batch: with one process, the whole global batch; with
    several, each process passes its own rows (``jax.make_array_from_process_local_data``). The
    same works on Explicit-axis meshes (``jax.make_mesh``'s default) and Auto ones.

    Raises:
      ValueError: a leaf without a leading axis, or whose leading axis the devices on
        ``axis_name`` cannot split evenly (the message names the leaf and the fix).

    Examples:
      >>> import jax, numpy as np, jaxcomm as jc
      >>> mesh = jax.make_mesh((jax.device_count(),), ("dp",))
      >>> x = jc.train.place_batch(np.zeros((8 * jax.device_count(), 3)), mesh, "dp")
      >>> x.sharding.spec == jax.sharding.PartitionSpec("dp")
      True
    """
    axis_name = canonical_axis(axis_name)
    n = mesh_axis_size(mesh, axis_name)
    sharding = NamedSharding(mesh, P(axis_name))

    def place(path, x):
        where = jax.tree_util.keystr(path) or "the batch"
        is_array = isinstance(x, jax.Array)
        if not is_array:
            x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError(
                f"jaxcomm: batch leaf {where} is a scalar; every batch leaf needs a leading "
                f"axis to split over {axis_name!r} (put per-step constants in the loss function)"
            )
        # Host data is this process's rows; an array (or a tracer: the step traced inside the
        # caller's jit, left for shard_map to place) is the global batch.
        parts = n if is_array else _devices_here(mesh, axis_name)
        if x.shape[0] % parts:
            raise ValueError(
                f"jaxcomm: batch leaf {where} has leading dimension {x.shape[0]}, which the "
                f"{parts} devices on axis {axis_name!r} cannot split evenly: pass a multiple of "
                f"{parts} rows (drop or pad the last batch)"
            )
        if not is_array:
            return jax.make_array_from_process_local_data(sharding, x)
        if isinstance(x, jax.core.Tracer) or x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(place, batch)
