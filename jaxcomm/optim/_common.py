"""Validation and small tree helpers shared by the optimizers of :mod:`jaxcomm.optim`.

Private to the subpackage (the module name starts with ``_``; its names do not).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.comm.all_reduce import compressed_pmean, compressed_pmean_or_fallback
from jaxcomm.comm.axes import AxisName, axis_names
from jaxcomm.comm.reduce import reduce_tree
from jaxcomm.comm.state import check_axis_size
from jaxcomm.comm.state import check_compressor as check_compressor
from jaxcomm.compressors import NoCompression
from jaxcomm.guard import all_of

PyTree = Any


def resolve_axis_size(axis_name: AxisName, axis_size=None) -> int | tuple[int, ...]:
    """The ``axis_size`` an optimizer's ``init`` builds its error feedback for.

    ``axis_size`` if given (an int, or the axes' sizes for a tuple of axes), else the bound
    size of ``axis_name`` (a tuple of sizes, slowest first, for a tuple of axes), else, for one
    unbound axis, ``jax.device_count()``. A tuple of axes that is not bound needs ``axis_size``.
    """
    names = axis_names(axis_name)
    if axis_size is not None:
        if isinstance(axis_size, tuple | list):
            sizes = check_axis_size(axis_size)
            if len(names) != (len(sizes) if isinstance(sizes, tuple) else 1):
                raise ValueError(
                    f"jaxcomm: axis_size {axis_size!r} does not match axis {axis_name!r}: give "
                    "one size per axis"
                )
            return sizes
        size = int(np.asarray(axis_size))
        if size < 1:
            raise ValueError(f"jaxcomm: axis_size must be a positive int, got {axis_size!r}")
        if len(names) > 1:
            raise ValueError(
                f"jaxcomm: axis {axis_name!r} is a tuple of axes: give axis_size as the tuple of "
                f"their sizes (slowest first), got {axis_size!r}"
            )
        return size
    try:
        sizes = tuple(int(lax.axis_size(a)) for a in names)
    except NameError:
        if len(names) > 1:
            raise ValueError(
                f"jaxcomm: axis {axis_name!r} is not bound here: call init inside the mesh "
                "(jc.make_train_step does), or pass axis_size=(slow size, fast size, ...)"
            ) from None
        return jax.device_count()
    return sizes[0] if len(sizes) == 1 else sizes


def static_bucket_bytes(bucket_bytes) -> int | None:
    """``bucket_bytes`` as a static int (or ``None``); a traced value is refused."""
    if bucket_bytes is None or isinstance(bucket_bytes, int):
        return bucket_bytes
    try:
        return int(np.asarray(bucket_bytes))
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(
            "jaxcomm: bucket_bytes must be a static int. Under optax.inject_hyperparams pass "
            "static_args=('bucket_bytes', 'axis_size')."
        ) from err


def check_static_range(
    opt: str, name: str, value, low=None, high=None, *, low_open=False, high_open=False
) -> None:
    """Raise for a hyperparameter known at trace time outside ``[low, high]`` (or open ends)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return  # traced (optax.inject_hyperparams) or an array: not checked
    v = float(value)
    bad = not np.isfinite(v)
    if low is not None:
        bad = bad or (v <= low if low_open else v < low)
    if high is not None:
        bad = bad or (v >= high if high_open else v > high)
    if bad:
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        interval = f"{'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
        raise ValueError(f"jaxcomm: {opt} {name} must be in {interval}, got {value!r}")


def f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def zeros_f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
    """The learning rate (a float or an optax schedule of the step count) as an fp32 scalar."""
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.asarray(lr, jnp.float32)


def is_static_zero(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def static_int(value) -> int | None:
    """``value`` as a Python int when it is known at trace time, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    return None


def needs_params(params, weight_decay, name: str) -> None:
    if params is None and not is_static_zero(weight_decay):
        raise ValueError(
            f"jaxcomm: {name} with weight_decay needs params: call update(grads, state, params)"
        )


def cast_like(updates: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda u, x: u.astype(jnp.asarray(x).dtype), updates, like)


def exact_mean(tree: PyTree, axis_name: str, bucket_bytes: int | None) -> PyTree:
    """Exact mean, fused into one collective per bucket (``NoCompression`` is stateless)."""
    out, _ = compressed_pmean(
        tree, None, axis_name=axis_name, compressor=NoCompression(), bucket_bytes=bucket_bytes
    )
    return out


def _keeping_leafless_state(reduce, tree, comm, *args, **kwargs) -> tuple:
    """``reduce(tree, comm, *args, **kwargs)``, given ``None`` for a leafless state (exact
    compressors) and returning that state as it was."""
    stateful = bool(jax.tree_util.tree_leaves(comm))
    out, new, *rest = reduce(tree, comm if stateful else None, *args, **kwargs)
    return (out, new if stateful else comm, *rest)


def compressed_mean_call(tree, comm, axis_name, compressor, bucket_bytes):
    """``compressed_pmean`` that keeps a leafless state (exact compressors) as it was."""
    kw = dict(axis_name=axis_name, compressor=compressor, bucket_bytes=bucket_bytes)
    return _keeping_leafless_state(compressed_pmean, tree, comm, **kw)


def compressed_mean_or_fallback_call(
    tree, comm, fallback, axis_name, compressor, bucket_bytes, return_fresh=False
):
    """``compressed_pmean_or_fallback`` that keeps a leafless state (exact compressors) as it
    was: ``(mean or fallback, state, finite)``, and the fresh mean with ``return_fresh``."""
    kw = dict(
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        return_fresh=return_fresh,
    )
    return _keeping_leafless_state(compressed_pmean_or_fallback, tree, comm, fallback, **kw)


def compressed_mean_packed_call(tree, comm, fallback, axis_name, compressor, bucket_bytes):
    """:func:`compressed_mean_or_fallback_call` with ``return_fresh``, and each bucket's mean
    as sent (``None`` where a bucket has no packed form): ``(mean or fallback, state, finite,
    fresh, packed)``. ``comm`` holds error feedback (a compressor with a packed mean has
    some)."""
    out, new, flags, fresh, packed = reduce_tree(
        tree, comm, axis_name, compressor, bucket_bytes, mean=True, op="all_reduce",
        fallback=fallback,
    )  # fmt: skip
    finite = all_of(flags)
    return out, new, finite, fresh, packed


def varying(tree: PyTree, axis_name: str) -> PyTree:
    return jax.tree.map(lambda x: ensure_varying(x, axis_name), tree)


def norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x)))


def unzip(out: PyTree, like: PyTree, k: int = 2) -> tuple:
    """A tree of ``k``-tuples (structured like ``like``) -> ``k`` trees."""
    treedef = jax.tree.structure(like)
    rows = treedef.flatten_up_to(out)
    return tuple(treedef.unflatten([row[i] for row in rows]) for i in range(k))
