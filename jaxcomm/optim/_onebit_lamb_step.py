"""One update of 1-bit LAMB (:func:`jaxcomm.optim.onebit_lamb.lamb_update`) besides its state:
the two phases, :func:`warm_up` (exact LAMB) and :func:`compressed` (the 1-bit momentum, its
fresh variance and the corrected trust ratio), and the per-leaf rules they share."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm.compressors import Compressor
from jaxcomm.fusion import written_once
from jaxcomm.guard import all_of
from jaxcomm.optim._common import PyTree, compressed_mean_call, exact_mean, f32, norm, unzip
from jaxcomm.optim._moments import damped_denominator, ema, leaf_mean


@dataclasses.dataclass(frozen=True)
class LambConfig:
    """The arguments of ``jc.scale_by_onebit_lamb`` and ``jc.onebit_lamb``, checked (their
    ``lamb_config``); numbers may be traced (``optax.inject_hyperparams``)."""

    b1: Any
    b2: Any
    eps: Any
    weight_decay: Any
    freeze_step: Any
    max_coeff: Any
    min_coeff: Any
    coeff_beta: Any
    factor_max: Any
    factor_min: Any
    factor_threshold: Any
    axis_name: Any  # an AxisName: one axis or a tuple of them
    compressor: Compressor
    bucket_bytes: int | None
    axis_size: int | None
    floor: float | None  # variance_floor; None under deepspeed_compat
    max_consecutive_skips: int | None
    bias_correction: bool
    precondition: bool


@dataclasses.dataclass(frozen=True)
class LambStep:
    """What one traced update of 1-bit LAMB reads besides its state (:func:`step_constants`)."""

    config: LambConfig
    b1: jax.Array
    b2: jax.Array
    eps: jax.Array
    wd: jax.Array
    t: jax.Array  # the 1-based update
    # Bias corrections (1 unless bias_correction): m by t; v by its last update, min(t, F);
    # v_fresh continues v's average, so by t.
    c1: jax.Array
    c2: jax.Array
    c2_fresh: jax.Array
    params: PyTree  # fp32
    scale: jax.Array | None  # multiplied into each leaf's trust ratio (-lr), or None
    first: jax.Array  # the first compressed update (t = freeze_step + 1)

    def scaled(self, coeff: jax.Array) -> jax.Array:
        """The leaf's factor of ``u``: ``scale * coeff`` (``coeff`` without a scale)."""
        return coeff if self.scale is None else self.scale * coeff


def step_constants(
    config: LambConfig,
    count: jax.Array,
    params: PyTree,
    scale,
) -> LambStep:
    """The :class:`LambStep` of the update after ``count`` updates."""
    b1, b2, eps = (jnp.asarray(x, jnp.float32) for x in (config.b1, config.b2, config.eps))
    t = optax.safe_increment(count)
    one = jnp.ones([], jnp.float32)
    tf = t.astype(jnp.float32)
    c2 = 1 - b2 ** jnp.maximum(jnp.minimum(t, config.freeze_step), 1).astype(jnp.float32)
    corrected = config.bias_correction
    return LambStep(
        config=config,
        b1=b1,
        b2=b2,
        eps=eps,
        wd=jnp.asarray(config.weight_decay, jnp.float32),
        t=t,
        c1=1 - b1**tf if corrected else one,
        c2=c2 if corrected else one,
        c2_fresh=1 - b2**tf if corrected else one,
        params=f32(params),
        scale=scale,
        first=t == config.freeze_step + 1,
    )


def denominator(
    s: LambStep, v: jax.Array, damped: bool = False, v_mean: jax.Array | None = None
) -> jax.Array:
    """``sqrt(v_hat) + eps``; ``damped``: the frozen variance's, floored (``variance_floor``),
    its leaf mean ``v_mean`` when known (no pass over ``v`` for it)."""
    if damped:
        mean = None if v_mean is None else v_mean / s.c2
        return damped_denominator(v / s.c2, s.eps, s.config.floor, mean=mean)
    return jnp.sqrt(v / s.c2) + s.eps


def lamb_leaf(s: LambStep, m, v, p, damped: bool = False, v_mean: jax.Array | None = None):
    """``(m_hat / (sqrt(v_hat) + eps), the same plus wd p, sqrt(v_hat) + eps)`` of one leaf."""
    denom = denominator(s, v, damped, v_mean)
    prelim = (m / s.c1) / denom
    return prelim, prelim + s.wd * p, denom


def trust_ratio(
    p: jax.Array, update: jax.Array, min_coeff, max_coeff
) -> tuple[jax.Array, jax.Array]:
    """``(clip(||p|| / ||update||, min_coeff, max_coeff), ||update||)``, the ratio 1 if either
    norm is 0."""
    w_norm, u_norm = norm(p), norm(update)
    ratio = jnp.clip(w_norm / jnp.where(u_norm > 0, u_norm, 1), min_coeff, max_coeff)
    return jnp.where((w_norm > 0) & (u_norm > 0), ratio, 1.0).astype(jnp.float32), u_norm


def warm_up(s: LambStep, g, mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, nu_mean):
    """The warm-up phase, ``t <= freeze_step``: LAMB on the exact mean gradient and the trust
    ratios' average ``coeff_freeze`` (``v_fresh`` is not read or written: the first compressed
    step starts it from the frozen ``v``). Returns the new moments and coefficients, the
    scaling coefficients of the new momentum (:func:`scaling_coefficients`: the compressed
    steps use the last warm-up's), each leaf's ``scaled(c) u``, whether the new moments and
    the step are finite (see :func:`step_finite`), and each leaf's mean of the new ``v`` (the
    compressed steps' damped denominators read it). The norms and means come out of the
    trust ratio's pass."""
    cfg = s.config
    g = exact_mean(g, cfg.axis_name, cfg.bucket_bytes)
    # The trust ratio's pass computes the moments and the update from the step's inputs
    # behind a barrier (on GPU), and writes nothing; the writing pass computes them again.
    # Else XLA:GPU writes the update for the norms and reads it back (3 passes more).
    mu_, nu_, p_ = written_once(mu, nu, s.params)
    mu, nu = ema(mu, g, s.b1), ema(nu, g, s.b2, 2)

    def leaf(m, v, p, m_, v_, p_, g, cf):
        v_, m_ = ema(v_, g, s.b2, 2), ema(m_, g, s.b1)
        _, update_, _ = lamb_leaf(s, m_, v_, p_)
        coeff, u_norm = trust_ratio(p_, update_, cfg.min_coeff, cfg.max_coeff)
        avg = cfg.coeff_beta * cf + (1 - cfg.coeff_beta) * coeff
        cf = jnp.where(coeff != 1.0, avg, cf).astype(jnp.float32)
        _, update, _ = lamb_leaf(s, m, v, p)
        v_mean = leaf_mean(v_)
        return s.scaled(coeff) * update, cf, step_finite(u_norm, v_mean), v_mean, norm(m_)

    out = jax.tree.map(leaf, mu, nu, s.params, mu_, nu_, p_, g, coeff_freeze)
    delta, coeff_freeze, finite, nu_mean, m_norms = unzip(out, mu, 5)
    finite = all_of(finite)
    scaling = scaling_coefficients(m_norms, mu)
    return mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, delta, finite, nu_mean


def step_finite(update_norm: jax.Array, variance_mean: jax.Array) -> jax.Array:
    """Whether one leaf's new moments and step are finite, from two scalars the step computes
    anyway (no pass of its own): the norm of its update ``u`` (non-finite wherever ``m`` is,
    the denominator being finite and positive, and the step is ``c u`` with a finite ``c``),
    and the mean of the variance it divides by (an Inf there would make ``u`` zero, not
    non-finite; the mean is what the floored denominators read). Both are sums: an update
    whose squares overflow fp32 (entries above ~1e19 / sqrt(size)), or a variance whose sum
    does (a mean above ~3e38 / size, which would make every floored denominator infinite),
    counts as not finite."""
    return jnp.isfinite(update_norm) & jnp.isfinite(variance_mean)


def onebit_momentum(s: LambStep, g, mu, nu, nu_mean, scaling, comm):
    """The 1-bit mean of the local momenta ``b1 m + (1-b1) g_r``: ``(m, scaling, comm)``.

    DeepSpeed's rule: each leaf's momentum times its ``scaling_coeff`` (the last warm-up
    update's, :func:`scaling_coefficients`), divided by it after the mean. ``precondition``:
    divided by the frozen denominator instead (floored with ``nu_mean``, the leaves' means of
    ``nu``; even magnitudes, one scale fits them), identical on every device, and mapped back
    by it.
    """
    cfg, b1 = s.config, s.b1
    if cfg.precondition:
        denom = jax.tree.map(lambda v, vm: denominator(s, v, True, vm), nu, nu_mean)
        local = jax.tree.map(lambda m, x, d: (b1 * m + (1 - b1) * x) / d, mu, g, denom)
        avg, comm = compressed_mean_call(
            local, comm, cfg.axis_name, cfg.compressor, cfg.bucket_bytes
        )
        return jax.tree.map(lambda a, d: a * d, avg, denom), scaling, comm
    # scaling: the last warm-up update's, kept since.
    local = jax.tree.map(lambda m, x, c: (b1 * m + (1 - b1) * x) * c, mu, g, scaling)
    avg, comm = compressed_mean_call(local, comm, cfg.axis_name, cfg.compressor, cfg.bucket_bytes)
    return jax.tree.map(lambda a, c: a / c, avg, scaling), scaling, comm


def correction_factor(s: LambStep, prelim, update, denom, vf, last) -> tuple[jax.Array, jax.Array]:
    """One leaf's correction factor of the frozen trust ratio (the rule in
    ``jc.scale_by_onebit_lamb``), from ``prelim = m_hat / denom``, the update ``u``, the frozen
    denominator, the fresh variance and the previous factor; and ``||u||``."""
    cfg = s.config
    u_norm = norm(update)
    # The fresh denominator is damped like the frozen one: a coordinate with no gradient has
    # v_fresh ~ 0 too, and would pin the max ratio at factor_max.
    fresh = damped_denominator(vf / s.c2_fresh, s.eps, cfg.floor)
    factor = jnp.max(denom / fresh, initial=0.0)
    ratio = jnp.where(
        u_norm > 0,
        jnp.minimum(1.0, norm(prelim) / jnp.where(u_norm > 0, u_norm, 1)),
        1.0,
    )
    factor = jnp.where(s.wd > 0, factor * ratio + (1 - ratio), factor)
    factor = jnp.maximum(jnp.minimum(factor, cfg.factor_max), cfg.factor_min)
    factor = jnp.minimum(factor, last * (1 + cfg.factor_threshold))
    return jnp.maximum(factor, last * (1 - cfg.factor_threshold)).astype(jnp.float32), u_norm


def compressed(s: LambStep, g, mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, nu_mean):
    """The compressed phase, ``t > freeze_step``: the 1-bit momentum (:func:`onebit_momentum`),
    the fresh variance of the gradient it implies, and each leaf's ``scaled(coeff_freeze f) u``
    (:func:`correction_factor`); the frozen ``v``'s means are the warm-up's."""
    m_prev = mu
    mu, scaling, comm = onebit_momentum(s, g, m_prev, nu, nu_mean, scaling, comm)

    first = s.first  # v_fresh starts from v, frozen at freeze_step

    def leaf(m, m_last, v, vm, vf, p, cf, last):
        g_rec = (m - s.b1 * m_last) / (1 - s.b1)
        vf = jnp.where(first, v, vf)  # read with v, which the step reads anyway
        vf = s.b2 * vf + (1 - s.b2) * jnp.square(g_rec)
        prelim, update, denom = lamb_leaf(s, m, v, p, damped=True, v_mean=vm)
        factor, u_norm = correction_factor(s, prelim, update, denom, vf, last)
        # The factor is finite where v_fresh is (its denominator is then finite, > 0).
        return (vf, factor, s.scaled(cf * factor) * update, step_finite(u_norm, leaf_mean(vf)))

    out = jax.tree.map(leaf, mu, m_prev, nu, nu_mean, nu_fresh, s.params, coeff_freeze, last_factor)
    nu_fresh, last_factor, delta, finite = unzip(out, mu, 4)
    finite = all_of(finite)
    return mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, delta, finite, nu_mean


def scaling_coefficients(norms: PyTree, mu: PyTree) -> PyTree:
    """1-bit LAMB's ``mean_q(s_q) / s_p`` with ``s_p = ||m_p|| / sqrt(numel_p)``, per leaf, from
    the momentum's leaf norms ``norms`` (structured like ``mu``).

    Empty leaves are left out of the mean; a leaf with ``s_p = 0`` (or an empty one) gets 1.
    """
    leaves, treedef = jax.tree.flatten(mu)
    norms = jax.tree.leaves(norms)  # one scalar per leaf of mu, in its order
    scales = [
        n / np.sqrt(m.size) if m.size else jnp.zeros([], jnp.float32)
        for n, m in zip(norms, leaves, strict=True)
    ]
    counted = [s for s, m in zip(scales, leaves, strict=True) if m.size]
    united = sum(counted) / len(counted) if counted else jnp.zeros([], jnp.float32)
    coeffs = [
        jnp.where(s > 0, united / jnp.where(s > 0, s, 1), 1.0).astype(jnp.float32) for s in scales
    ]
    return jax.tree.unflatten(treedef, coeffs)
