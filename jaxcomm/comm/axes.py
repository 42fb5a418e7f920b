"""Axis names: one mesh axis, or a tuple of axes, slowest link first.

Everywhere jaxcomm takes an ``axis_name`` it takes either one mesh axis (``"dp"``) or a tuple of
mesh axes ordered from the slowest link to the fastest, e.g. ``("host", "local")`` on
``jax.make_mesh((nodes, devices_per_node), ("host", "local"))``. Data parallelism runs over all
of them. A tuple selects the *two-level* transport (:mod:`jaxcomm.comm.reduce`): a bucket is
reduced exactly over the trailing (fast) axes, only the resulting ``1/n_fast`` share is
compressed and exchanged across the first (slow) axis, and the shares are gathered back over the
fast axes. A one-element tuple means its one axis.
"""

from __future__ import annotations

import math

import jax

from jaxcomm._compat import bound_axis_size

#: One mesh axis, or a tuple of them, slowest first.
AxisName = str | tuple[str, ...]


def axis_names(axis_name) -> tuple[str, ...]:
    """``axis_name`` as a tuple of axis names, checked (a clear error for anything else)."""
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, tuple | list) and axis_name:
        names = tuple(axis_name)
        if not all(isinstance(a, str) for a in names):
            raise TypeError(f"jaxcomm: axis names must be strings, got {axis_name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"jaxcomm: axis {axis_name!r} names an axis twice")
        return names
    raise TypeError(
        "jaxcomm: axis_name must be a mesh axis name or a non-empty tuple of them (slowest "
        f"link first, e.g. ('host', 'local')), got {axis_name!r}"
    )


def canonical_axis(axis_name) -> AxisName:
    """The one spelling of ``axis_name``: a string for one axis, a tuple for several."""
    names = axis_names(axis_name)
    return names[0] if len(names) == 1 else names


def is_two_level(axis_name) -> bool:
    """Whether ``axis_name`` names several axes (the two-level transport)."""
    return len(axis_names(axis_name)) > 1


def split_levels(axis_name) -> tuple[str, tuple[str, ...]]:
    """``(slow axis, fast axes)``: the first axis and the rest (empty for one axis)."""
    names = axis_names(axis_name)
    return names[0], names[1:]


def bound_level_sizes(axis_name) -> tuple[int, int]:
    """``(slow size, fast size)`` of bound axes (fast size 1 for one axis)."""
    slow, fast = split_levels(axis_name)
    return bound_axis_size(slow), math.prod(bound_axis_size(a) for a in fast)


def level_sizes(axis_size) -> tuple[int, int]:
    """``(slow size, fast size)`` from an ``axis_size``: an int (one axis) or a tuple of the
    axes' sizes, slowest first."""
    if isinstance(axis_size, tuple | list):
        return int(axis_size[0]), math.prod(int(s) for s in axis_size[1:])
    return int(axis_size), 1


def mesh_axis_size(mesh: jax.sharding.Mesh, axis_name) -> int:
    """Devices on ``axis_name`` of ``mesh`` (the product over a tuple), or a clear error."""
    names = axis_names(axis_name)
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"jaxcomm: axis {canonical_axis(axis_name)!r} is not an axis of the mesh "
            f"{dict(mesh.shape)}"
        )
    return math.prod(int(mesh.shape[a]) for a in names)


def mesh_axis_sizes(mesh: jax.sharding.Mesh, axis_name) -> int | tuple[int, ...]:
    """The ``axis_size`` of ``axis_name`` on ``mesh``: an int for one axis, the tuple of the
    axes' sizes (slowest first) for several."""
    mesh_axis_size(mesh, axis_name)
    names = axis_names(axis_name)
    sizes = tuple(int(mesh.shape[a]) for a in names)
    return sizes[0] if len(sizes) == 1 else sizes
