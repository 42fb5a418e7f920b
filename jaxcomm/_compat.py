"""Small shims over JAX APIs that moved between releases, and axis checks.

jaxcomm targets jax >= 0.8 (``jax.shard_map`` with ``check_vma``). Everything that touches a
private or recently renamed JAX symbol lives here so the rest of the package reads plainly:
the gather typed as replicated, whether the backends exist, ``jax.distributed``'s state.
"""

from __future__ import annotations

import jax
from jax import lax

try:  # jax >= 0.7: the gather whose result is typed as replicated along the axis.
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - older or newer layouts
    _all_gather_invariant = None  # type: ignore[assignment]


def bound_axis_size(axis_name: str) -> int:
    """Size of a bound mesh/pmap axis, or a clear error naming the unbound axis.

    ``lax.axis_size`` raises a bare ``NameError: unbound axis name`` deep in tracing; users of a
    collective deserve to be told where the axis has to come from.
    """
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"jaxcomm: axis name {axis_name!r} is not bound here. Call jaxcomm collectives inside "
            f"jax.shard_map (over a mesh with axis {axis_name!r}) or jax.pmap(axis_name="
            f"{axis_name!r}), or inside an optax update that runs there."
        ) from err


def _axes(axis_name) -> tuple:
    """Axis names as a tuple: collectives accept one name or a tuple of mesh axes."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def varying_axes(x) -> frozenset:
    """Axes along which ``x`` is typed device-varying (empty outside ``check_vma`` tracing)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.9 keeps the varying axes on aval.mat
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def ensure_varying(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """Mark ``x`` as varying along ``axis_name`` (a no-op outside ``check_vma`` tracing).

    all_to_all and all_gather require device-varying operands under ``check_vma=True``; a
    replicated input is, by definition, the same value on every device, so casting it is exact.
    """
    missing = tuple(a for a in _axes(axis_name) if a not in varying_axes(x))
    if not missing:
        return x
    try:
        return lax.pcast(x, missing, to="varying")
    except (ValueError, TypeError, NameError, AssertionError):
        # pmap, vmap(axis_name=...) and shard_map(check_vma=False) carry no varying-ness types
        # (under vmap inside lax.cond, pcast fails an internal assertion instead).
        return x


#: JAX's platform names for NVIDIA and AMD GPUs (devices' ``platform``, ``jax_platforms``).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def same_trace(x: object, like: object) -> bool:
    """Whether ``x`` and ``like`` are tracers of one trace (a value computed in a nested
    ``lax.cond`` branch, ``vmap`` or ``scan`` is not; ``False`` for concrete values, or where
    JAX keeps no ``_trace`` on its tracers)."""
    trace = getattr(like, "_trace", None)
    return trace is not None and getattr(x, "_trace", None) is trace


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` typed device-varying along every axis ``like`` varies along (a no-op outside
    ``check_vma`` tracing): the two branches of a ``lax.cond`` must agree on it."""
    axes = tuple(sorted(varying_axes(like) - varying_axes(x)))
    return ensure_varying(x, axes) if axes else x


def all_gather_replicated(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """``all_gather`` (stacked on a new leading axis) whose result is typed as replicated.

    A plain ``lax.all_gather`` result is typed device-varying under ``check_vma``, which would force
    users to return reduced gradients/params with ``out_specs=P(axis)``. The values are identical
    on every device, so the invariant variant states the truth.
    """
    if _all_gather_invariant is not None and set(_axes(axis_name)) <= varying_axes(x):
        return _all_gather_invariant(x, axis_name)
    return lax.all_gather(x, axis_name)


def backends_initialized() -> bool:
    """Whether JAX has created its backends (too late then for jax.distributed and XLA flags)."""
    # jax._src.xla_bridge is private but stable for years; if it moves, fall back to letting
    # jax.distributed.initialize raise its own error.
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover
        return False


def distributed_global_state():
    """``jax.distributed``'s global state, read without starting a backend; ``None`` if the
    private module moved (jax 0.8-0.10 keep it in ``jax._src.distributed``)."""
    try:
        from jax._src import distributed as _dist

        return _dist.global_state
    except (ImportError, AttributeError):  # pragma: no cover - a newer JAX layout
        return None
