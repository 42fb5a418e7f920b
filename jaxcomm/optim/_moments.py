"""The moment updates the optimizers of :mod:`jaxcomm.optim` share: the EMA, the damped
denominator of a frozen variance and DeepSpeed's momentum mask."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.optim._common import is_static_zero

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


def leaf_mean(v: jax.Array) -> jax.Array:
    """``mean(v)`` in fp32 (0 for an empty leaf, whose denominator never reads it)."""
    return jnp.mean(v) if v.size else jnp.zeros([], jnp.float32)


def damped_denominator(
    v: jax.Array,
    eps: jax.Array,
    floor: float | None,
    *,
    scale: jax.Array | float = 1.0,
    enabled: jax.Array | bool = True,
    mean: jax.Array | None = None,
) -> jax.Array:
    """``max(sqrt(v / scale), floor * rms) + eps`` with ``rms = sqrt(mean(v) / scale)`` over the
    leaf (``enabled`` false, a bool that may be traced: ``sqrt(v / scale) + eps``). ``mean``:
    ``mean(v)`` if known (a variance that has not changed since it was taken: no pass over
    ``v`` for it).

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
    rms = jnp.sqrt((jnp.mean(v) if mean is None else mean) / scale)
    low = jnp.where(enabled, jnp.asarray(floor, v.dtype) * rms, jnp.zeros_like(rms))
    return jnp.maximum(root, low) + eps


def apply_mask(tree: PyTree, mask: PyTree | None) -> PyTree:
    """``tree * mask`` leaf by leaf (DeepSpeed's ``exp_avg_mask``); ``mask=None``: ``tree``."""
    if mask is None:
        return tree
    return jax.tree.map(lambda x, k: x * jnp.asarray(k, x.dtype), tree, mask)


# Run length: the warm-up of the 1-bit optimizers.

#: Share of the run that 1-bit Adam / 1-bit LAMB keep exact when given ``total_steps`` (the
#: paper's and DeepSpeed's advice, and 0/1 Adam's ``var_freeze_step`` from ``total_steps``).
FREEZE_FRACTION = 0.15


def resolve_freeze_step(name: str, freeze_step, total_steps: int | None):
    """``freeze_step`` if given, else ``max(1, round(0.15 * total_steps))``; neither: an error.

    A 1-bit optimizer with no run length would otherwise need a constant warm-up (DeepSpeed's
    100000 steps of exact Adam, longer than most runs, without a word)."""
    if total_steps is not None:
        total = total_steps if isinstance(total_steps, int | np.integer) else None
        if total is None or isinstance(total_steps, bool) or total < 1:
            raise ValueError(
                f"jaxcomm: {name} total_steps must be an int >= 1, got {total_steps!r}"
            )
        if freeze_step is None:
            return max(1, round(FREEZE_FRACTION * int(total)))
    if freeze_step is None:
        raise ValueError(
            f"jaxcomm: {name} needs the run length: pass total_steps=N (the variance freezes "
            f"after round(0.15 * N) exact steps) or freeze_step=K (K exact warm-up steps)"
        )
    return freeze_step


def clip_step_rms(
    step: jax.Array,
    max_rms: float | None,
    enabled: jax.Array | bool,
    mean_square: jax.Array | None = None,
) -> jax.Array:
    """``step * min(1, max_rms / rms(step))`` with ``rms`` over the leaf, where ``enabled``
    (``max_rms=None``, an empty leaf or ``enabled`` false: ``step`` itself). ``mean_square``,
    where given, is ``mean(step^2)`` known without reading ``step`` (a 1-bit mean's, from its
    scales).

    The bound of the 1-bit optimizers after their variance freeze. Adam's step ``m_hat /
    sqrt(v_hat)`` has a mean square of at most 1 per coordinate when the gradients are
    stationary (``E[m_hat^2] <= E[g^2] = v``); a frozen ``v`` no longer follows the gradients,
    and when they grow after the freeze (early in training: a short warm-up) the step grows
    with them, the loss with the step, and the gradients with the loss, until the run is NaN.
    The factor is exactly 1 where the bound does not bind (the step is then unchanged, bit
    for bit)."""
    if max_rms is None or step.size == 0 or enabled is False:
        return step
    if mean_square is None:
        mean_square = jnp.mean(jnp.square(step))
    rms = jnp.sqrt(jnp.asarray(mean_square, step.dtype))
    factor = jnp.minimum(jnp.ones([], step.dtype), jnp.asarray(max_rms, step.dtype) / rms)
    if enabled is not True:
        factor = jnp.where(enabled, factor, jnp.ones_like(factor))
    return step * factor
