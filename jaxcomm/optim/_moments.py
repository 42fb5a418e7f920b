"""The moment updates the optimizers of :mod:`jaxcomm.optim` share: the EMA, the damped
denominator of a frozen variance and DeepSpeed's momentum mask."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def ema(moments: PyTree, values: PyTree, decay: jax.Array, order: int = 1) -> PyTree:
    """``decay * moments + (1 - decay) * values**order``, the EMA of ``optax.tree.update_moment``.

    Not ``optax.tree.update_moment`` itself: it writes the two terms in the other order, and XLA
    on CPU then fuses the sum into a multiply-add the other way round, which changes fp32 results
    in the last bit. ``decay``
    is an fp32 array, so ``1 - decay`` is rounded in fp32 as DeepSpeed's fp32 buffers do (a Python
    float would round ``1 - 0.9`` in double first).
    """
    return jax.tree.map(lambda m, x: decay * m + (1 - decay) * x**order, moments, values)


# Frozen variance: damping of (near) zero-variance coordinates.


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
    if floor is None or _static_zero(floor) or v.size == 0:
        return root + eps
    rms = jnp.sqrt(jnp.mean(v) / scale)
    low = jnp.where(enabled, jnp.asarray(floor, v.dtype) * rms, jnp.zeros_like(rms))
    return jnp.maximum(root, low) + eps


def apply_mask(tree: PyTree, mask: PyTree | None) -> PyTree:
    """``tree * mask`` leaf by leaf (DeepSpeed's ``exp_avg_mask``); ``mask=None``: ``tree``."""
    if mask is None:
        return tree
    return jax.tree.map(lambda x, k: x * jnp.asarray(k, x.dtype), tree, mask)


def _static_zero(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0
