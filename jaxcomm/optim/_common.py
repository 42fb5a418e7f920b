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
from jaxcomm.comm.state import ReduceState, plan_tree
from jaxcomm.comm.state import check_compressor as check_compressor
from jaxcomm.compressors import Compressor, NoCompression
from jaxcomm.compressors import keep_if as keep_if
from jaxcomm.optim.schedule import recording_phases

PyTree = Any


def resolve_axis_size(axis_name: str, axis_size: int | None = None) -> int:
    """``axis_size`` if given, else the bound size of ``axis_name``, else ``jax.device_count()``."""
    if axis_size is not None:
        size = int(np.asarray(axis_size))
        if size < 1:
            raise ValueError(f"jaxcomm: axis_size must be a positive int, got {axis_size!r}")
        return size
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return jax.device_count()


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


def ema(moments: PyTree, values: PyTree, decay: jax.Array, order: int = 1) -> PyTree:
    """``decay * moments + (1 - decay) * values**order``, the EMA of ``optax.tree.update_moment``.

    Not ``optax.tree.update_moment`` itself: it writes the two terms in the other order, and XLA
    on CPU then fuses the sum into a multiply-add the other way round, which changes fp32 results
    in the last bit (measured: every 1-bit optimizer differed from its previous release). ``decay``
    is an fp32 array, so ``1 - decay`` is rounded in fp32 as DeepSpeed's fp32 buffers do (a Python
    float would round ``1 - 0.9`` in double first).
    """
    return jax.tree.map(lambda m, x: decay * m + (1 - decay) * x**order, moments, values)


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


def compressed_mean_or_fallback_call(tree, comm, fallback, axis_name, compressor, bucket_bytes):
    """``compressed_pmean_or_fallback`` that keeps a leafless state (exact compressors) as it
    was: ``(mean or fallback, state, finite)``."""
    kw = dict(axis_name=axis_name, compressor=compressor, bucket_bytes=bucket_bytes)
    return _keeping_leafless_state(compressed_pmean_or_fallback, tree, comm, fallback, **kw)


def floating_buckets(tree: PyTree, compressor: Compressor, bucket_bytes: int | None) -> int:
    """How many non-empty floating buckets the collectives cut ``tree`` into."""
    _, _, buckets = plan_tree(tree, compressor, bucket_bytes)
    return sum(1 for b in buckets if b.numel and not b.exact)


def keep_error_feedback(ok, new, old, tree, compressor, bucket_bytes):
    """The collectives' new state, or on a skipped step (``ok`` false) every bucket's old one.

    Each bucket's guard keeps only its own error feedback when its own mean is not finite; an
    optimizer that skips the whole step keeps all of them (the count of non-finite calls still
    moves). With one floating bucket the guard has already done it: no select.
    """
    if not isinstance(new, ReduceState) or floating_buckets(tree, compressor, bucket_bytes) <= 1:
        return new
    return new._replace(buckets=keep_if(ok, new.buckets, old.buckets))


def varying(tree: PyTree, axis_name: str) -> PyTree:
    return jax.tree.map(lambda x: ensure_varying(x, axis_name), tree)


def norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x)))


def unzip(out: PyTree, like: PyTree, k: int = 2) -> tuple:
    """A tree of ``k``-tuples (structured like ``like``) -> ``k`` trees."""
    treedef = jax.tree.structure(like)
    rows = treedef.flatten_up_to(out)
    return tuple(treedef.unflatten([row[i] for row in rows]) for i in range(k))


# --------------------------------------------------------------------------------------------
# Frozen variance: damping of (near) zero-variance coordinates


def damped_denominator(
    v: jax.Array,
    eps: jax.Array,
    floor: float | None,
    *,
    scale: jax.Array | float = 1.0,
    enabled: jax.Array | bool = True,
) -> jax.Array:
    """``max(sqrt(v / scale), floor * rms) + eps`` with ``rms = sqrt(mean(v) / scale)`` over the
    leaf (``enabled`` false, a bool that may be traced: ``sqrt(v / scale) + eps``).

    The rule of the 1-bit optimizers after their variance freeze (``scale`` is the bias
    correction of ``v``): a coordinate whose frozen ``sqrt(v)`` is below ``floor`` times the
    leaf's root-mean variance (an embedding row of a byte never or rarely seen during the
    warm-up, the key part of an attention bias) is divided by that floor instead of by
    ``~eps``: 1-bit compression hands it a non-zero momentum (a bucket scale times a sign),
    which would otherwise become a ``m / eps`` step. ``floor=None`` (or 0): ``sqrt(v / scale) +
    eps``, DeepSpeed's rule.
    """
    root = jnp.sqrt(v / scale)
    if floor is None or is_static_zero(floor) or v.size == 0:
        return root + eps
    rms = jnp.sqrt(jnp.mean(v) / scale)
    low = jnp.where(enabled, jnp.asarray(floor, v.dtype) * rms, jnp.zeros_like(rms))
    return jnp.maximum(root, low) + eps


def apply_mask(tree: PyTree, mask: PyTree | None) -> PyTree:
    """``tree * mask`` leaf by leaf (DeepSpeed's ``exp_avg_mask``); ``mask=None``: ``tree``."""
    if mask is None:
        return tree
    return jax.tree.map(lambda x, k: x * jnp.asarray(k, x.dtype), tree, mask)


# --------------------------------------------------------------------------------------------
# Non-finite steps


def all_finite(*trees: PyTree) -> jax.Array:
    """One bool scalar: no leaf holds a NaN or an Inf.

    Decided as ``isfinite(sum_leaves sum(x))``: a NaN or Inf anywhere makes the sum NaN or Inf,
    and a float sum over a buffer that exists anyway is the cheapest reduction XLA:CPU has (a
    boolean ``all(isfinite(x))`` materialises a mask per leaf and reduces it in a tree of
    ``reduce-window``s: measured 60 ms more per 0/1 Adam step on a 64 MiB model). The one
    false alarm: finite values whose sum passes the fp32 range (``|sum| > 3.4e38``), a step
    that would blow up anyway, is skipped too. The result is replicated when the trees are.
    """
    total = jnp.zeros([], jnp.float32)
    for x in (x for t in trees for x in jax.tree.leaves(t)):
        if jnp.size(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            total = total + jnp.sum(x, dtype=jnp.float32)
    return jnp.isfinite(total)


def mean_finite(
    mean: PyTree,
    old_comm: PyTree,
    new_comm: PyTree,
    axis_name: str,
    *,
    replicated: bool = True,
    compressor: Compressor | None = None,
) -> jax.Array:
    """Whether a ``compressed_pmean`` result ``mean`` is finite (a bool scalar).

    Read from the collectives' guard when the state counts non-finite calls (``nonfinite``
    unchanged on every device: no pass over the mean; the guard decides from the few values it
    already has, e.g. OneBit's scales, of which every output element is one times a sign), else
    :func:`all_finite` of ``mean``. ``replicated``: typed as replicated (one int32 ``pmin``);
    ``False`` for a caller that takes its own ``pmin`` of the flag (the result is then typed as
    varying, with the same value on every device). A ``compressor`` whose guarded output is
    NaN or finite as a whole (``output_decides_finite``, OneBit) and an fp32 ``mean``: the
    first element of each leaf decides, replicated as the mean is, with no ``pmin`` (a
    collective's fixed cost, ~3-8 ms a step on a shaped 1 Gbit/s link).
    """
    leaves = [x for x in jax.tree_util.tree_leaves(mean) if x.size]
    if (
        replicated
        and getattr(compressor, "output_decides_finite", False)
        and all(x.dtype == jnp.float32 for x in leaves)
    ):
        return jnp.all(jnp.stack([jnp.isfinite(x.reshape(-1)[0]) for x in leaves] or [True]))
    counter = getattr(new_comm, "nonfinite", ())
    if not jax.tree_util.tree_leaves(counter):
        finite = all_finite(mean)
        return finite if replicated else ensure_varying(finite, axis_name)
    same = ensure_varying(jnp.all(counter == old_comm.nonfinite), axis_name)
    if not replicated:
        return same
    return lax.pmin(same.astype(jnp.int32), axis_name) > 0


def check_skips(skipped: jax.Array, limit: int | None, name: str) -> None:
    """Raise at run time (``FloatingPointError`` inside a ``JaxRuntimeError``) once ``skipped``
    consecutive non-finite steps exceed ``limit`` (``None``: never, and no host callback: the
    check is one ``jax.debug.callback`` per step)."""
    if limit is None or recording_phases():  # the probe of a phased step has no effects
        return

    def check(n, cap):
        n, cap = int(np.max(np.asarray(n))), int(np.min(np.asarray(cap)))
        if n > cap:
            raise FloatingPointError(
                f"jaxcomm: {name} skipped {n} consecutive steps whose gradients, mean or update "
                f"were not finite (max_consecutive_skips={cap}): the run is diverging or its "
                "data is bad; lower the learning rate, check the inputs, or resume from a "
                "checkpoint"
            )

    # The host checks again (under vmap a lax.cond on a batched predicate runs both branches,
    # so the callback fires on every step there). In a cond elsewhere it costs nothing until it
    # is due: an unconditional callback took ~1.2 ms of every 1-bit Adam step (MLP, one core).
    # The limit is an argument, not a closure: optax.inject_hyperparams traces it.
    def due(n, cap):
        jax.debug.callback(check, n, cap)

    jax.lax.cond(jnp.any(skipped > limit), due, lambda n, cap: None, skipped, limit)
