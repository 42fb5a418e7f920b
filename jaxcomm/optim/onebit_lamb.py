"""DeepSpeed's 1-bit LAMB: exact LAMB warm-up, then 1-bit momentum with frozen trust ratios.

Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
LAMB's Convergence Speed" (arXiv:2104.06069). Two pieces, like :mod:`jaxcomm.optim.onebit_adam`:

* :func:`scale_by_onebit_lamb`: the direction ``c u`` per leaf (``u`` LAMB's update with weight
  decay, ``c`` its trust ratio, frozen and corrected after the switch): the communication, the
  moments and the coefficients, in one :class:`OneBitLambState`;
* :func:`onebit_lamb`: ``-lr c u`` in the parameters' dtype.

:func:`lamb_update` runs one update; its two phases are named functions of
:mod:`jaxcomm.optim._onebit_lamb_step` (``warm_up``: exact LAMB; ``compressed``: the 1-bit
momentum and the corrected trust ratio). Bit identity keeps ``-lr`` inside ``onebit_lamb``: it
multiplies each leaf's trust ratio before the update, ``(-lr c) u``, which
``optax.scale_by_learning_rate`` after the direction rounds differently (their updates agree bit
for bit only when ``lr`` is a power of two).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxcomm.comm.axes import AxisName
from jaxcomm.comm.state import ReduceState, init_state
from jaxcomm.compressors import Compressor, OneBit
from jaxcomm.guard import SkipCounters, keep_if
from jaxcomm.optim._common import (
    PyTree,
    cast_like,
    check_compressor,
    check_static_range,
    f32,
    learning_rate_at,
    resolve_axis_size,
    static_bucket_bytes,
    static_int,
    zeros_f32,
)
from jaxcomm.optim._moments import resolve_freeze_step
from jaxcomm.optim._onebit_lamb_step import (
    LambConfig,
    compressed,
    step_constants,
    warm_up,
)
from jaxcomm.optim._skip import count_skips, keep_error_feedback, zeros_unless
from jaxcomm.optim.schedule import phase, phase_cond, steady_below


class OneBitLambState(NamedTuple):
    """State of :func:`scale_by_onebit_lamb` and :func:`onebit_lamb`. Everything but ``comm`` is
    replicated.

    Attributes:
      count: updates done so far (int32 scalar).
      mu: first moment, fp32 (after the switch: the 1-bit mean with the scaling removed).
      nu: second moment, fp32, frozen after ``freeze_step``.
      nu_fresh: DeepSpeed's ``exp_avg_sq_fresh``, fp32: zero during the warm-up; the first
        compressed update starts it from ``nu`` (frozen at update ``freeze_step``) and every
        compressed update moves it by the gradient reconstructed from the momenta.
      coeff_freeze: per leaf, an fp32 scalar: the EMA of the warm-up trust ratios
        (DeepSpeed's ``lamb_coeff_freeze``, starts at 0), frozen after ``freeze_step``.
      last_factor: per leaf, an fp32 scalar: the previous correction factor (starts at 1).
      scaling_coeff: per leaf, an fp32 scalar: the momentum scaling coefficient (1 at first),
        taken by every warm-up update from its new momentum; the compressed updates use the
        last one's (DeepSpeed's, computed at the switch from the same momentum).
      comm: error feedback of the 1-bit momentum all-reduce (per-device ``jc.ReduceState``).
      skips: the updates skipped because they were not finite, in a row and in all
        (:class:`~jaxcomm.guard.SkipCounters`).
      nu_mean: per leaf, an fp32 scalar: the mean of ``nu``, taken by the warm-up updates that
        write ``nu``; the compressed updates' damped denominators (``variance_floor``) read it
        instead of a pass over the frozen ``nu``.
    """

    count: jax.Array
    mu: PyTree
    nu: PyTree
    nu_fresh: PyTree
    coeff_freeze: PyTree
    last_factor: PyTree
    scaling_coeff: PyTree
    comm: ReduceState
    skips: SkipCounters
    nu_mean: PyTree


def scale_by_onebit_lamb(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int | None = None,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    *,
    axis_name: AxisName,
    total_steps: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    variance_floor: float | None = 0.1,
    deepspeed_compat: bool = False,
    max_consecutive_skips: int | None = 16,
    bias_correction: bool = False,
    precondition: bool = False,
) -> optax.GradientTransformation:
    """1-bit LAMB's direction ``c u`` per leaf, from this device's local gradients.

    Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
    LAMB's Convergence Speed" (arXiv:2104.06069). Every leaf of the parameter tree is one of
    DeepSpeed's parameter tensors: trust ratios and coefficients are per leaf. With
    ``t = count + 1`` the 1-based update, ``g_r`` this device's gradient, ``p`` a leaf of the
    parameters and norms taken over the leaf (DeepSpeed defaults in brackets):

    * warm-up, ``t <= freeze_step`` (``round(0.15 * total_steps)``): LAMB on the exact mean
      gradient ``g = mean_r g_r``:
      ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``; ``u = m / (sqrt(v) + eps) + wd p``;
      the trust ratio ``c = clip(||p|| / ||u||, min_coeff (0.01), max_coeff (10))``, or
      ``c = 1`` when either norm is 0; if ``c != 1``, ``coeff_freeze = coeff_beta (0.9)
      coeff_freeze + (1 - coeff_beta) c`` (DeepSpeed's rule, including the skip at exactly 1);
      the direction is ``c u``. At ``t = freeze_step``, ``v_fresh = v``.
    * the switch, ``t = freeze_step + 1``, before anything else: per leaf ``s_p = ||m_p|| /
      sqrt(numel_p)`` and ``scaling_coeff_p = mean_q(s_q) / s_p``, kept for the rest of the run.
    * compression, ``t > freeze_step``: ``m_prev = m``; ``m_r = (b1 m + (1-b1) g_r) *
      scaling_coeff`` locally; ``m = OneBit-mean_r(m_r) / scaling_coeff`` (worker and server
      error feedback; ``v`` stays frozen); ``g~ = (m - b1 m_prev) / (1 - b1)`` and ``v_fresh =
      b2 v_fresh + (1-b2) g~^2``; ``u = m / (sqrt(v) + eps) + wd p``; the correction factor
      ``f = max(elementwise (sqrt(v) + eps) / (sqrt(v_fresh) + eps))``, with weight decay
      ``r = min(1, ||m / (sqrt(v) + eps)|| / ||u||)`` and ``f = f r + (1 - r)``; then ``f`` is
      clipped to ``[factor_min (0.5), factor_max (4)]`` and to ``[(1 - factor_threshold (0.1))
      f_prev, (1 + factor_threshold) f_prev]`` (``f_prev`` starts at 1); the direction is
      ``coeff_freeze f u``.

    The direction is fp32 and identical on every device; chain it like ``optax.scale_by_adam``:
    ``optax.chain(jc.scale_by_onebit_lamb(axis_name="dp", total_steps=1000),
    optax.scale_by_learning_rate(1e-3))``. Weight decay stays an argument: the trust ratio is of
    the update with it. :func:`onebit_lamb` multiplies ``-lr`` into each trust ratio before
    ``u`` instead (DeepSpeed's order, and its results of earlier versions bit for bit), so that
    chain's updates differ from it by one rounding (none for a power-of-two ``lr``). The
    arguments are those of :func:`onebit_lamb`; ``update`` needs ``params`` and returns zeros on
    a skipped step.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm as jc
      >>> tx = optax.chain(jc.scale_by_onebit_lamb(axis_name="dp", freeze_step=2, axis_size=2),
      ...                  optax.scale_by_learning_rate(1e-3))
      >>> params = {"w": jnp.ones(4)}
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")
      >>> updates, state = step({"w": jnp.ones((2, 4))}, state)
      >>> [round(float(u), 6) for u in updates["w"][0]]  # c u = 1 here: ||p|| / ||u|| = 1 / u
      [-0.001, -0.001, -0.001, -0.001]
    """
    config = lamb_config(
        b1,
        b2,
        eps,
        weight_decay,
        freeze_step,
        max_coeff,
        min_coeff,
        coeff_beta,
        factor_max,
        factor_min,
        factor_threshold,
        axis_name=axis_name,
        total_steps=total_steps,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        axis_size=axis_size,
        variance_floor=variance_floor,
        deepspeed_compat=deepspeed_compat,
        max_consecutive_skips=max_consecutive_skips,
        bias_correction=bias_correction,
        precondition=precondition,
    )
    return optax.GradientTransformation(
        partial(lamb_init, config), partial(lamb_update, config, None)
    )


def onebit_lamb(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int | None = None,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    *,
    axis_name: AxisName,
    total_steps: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    variance_floor: float | None = 0.1,
    deepspeed_compat: bool = False,
    max_consecutive_skips: int | None = 16,
    bias_correction: bool = False,
    precondition: bool = False,
) -> optax.GradientTransformation:
    """DeepSpeed's 1-bit LAMB (``OnebitLamb``) as an optax transformation over local gradients.

    :func:`scale_by_onebit_lamb`'s rules (see there: the warm-up, the switch, the compressed
    steps) with the learning rate: the returned optax update is ``(-lr(count) c) u`` per leaf,
    ``c`` the trust ratio (``coeff_freeze f`` after the switch), in each parameter's dtype
    (apply it with ``optax.apply_updates``). ``-lr`` stays inside, multiplied into ``c`` first as
    DeepSpeed does: splitting it out (``scale_by_learning_rate`` after the direction) changes
    the result by a rounding.

    Like DeepSpeed there is no bias correction (DeepSpeed reads the flag and ignores it), and
    ``update`` always needs ``params`` (the trust ratio uses ``||p||``).

    Differences from DeepSpeed, on purpose: DeepSpeed's first ``step()`` only allocates buffers
    (so it runs ``freeze_step - 1`` real warm-up updates); here every call is an update and
    there are exactly ``freeze_step`` warm-up updates (in both, ``v_fresh`` is ``v`` after the
    last of them). The error feedback is part of the state and
    survives checkpoints (DeepSpeed drops it on load, and restarts the warm-up coefficients when
    loading a warm-up checkpoint; here a resumed run is the uninterrupted run). A leaf whose
    momentum is all zero at the switch gets ``scaling_coeff = 1`` (DeepSpeed divides by zero)
    and empty leaves are left out of the mean; an update of norm 0 gives ``r = 1``. DeepSpeed's
    ``exp_avg_mask`` is not supported. The momenta of all leaves are one flat buffer as in
    DeepSpeed when ``bucket_bytes=None`` (the default), padded to a multiple of ``8 n`` (jaxcomm's
    rule; DeepSpeed pads to a multiple of ``n lcm(n, 8)``, the same for ``n`` = 1, 2, 4, 8), and
    the padding is zero at every step (DeepSpeed's fused buffer keeps its padding tail between
    steps, so the tail carries the previous step's 1-bit output into the next scales).

    Safe defaults (``deepspeed_compat=True``: DeepSpeed's rules exactly; both rule sets are
    tested against NumPy models), chosen on the byte-level transformer LM of
    ``benchmarks/convergence.py`` (8 and 2 devices, 384-768 steps; the CHANGELOG has the
    numbers): after the switch the denominator ``sqrt(v) + eps`` of the update is floored as in
    :func:`jaxcomm.onebit_adam` (``variance_floor``: coordinates whose frozen variance is ~0
    would otherwise take ``m / eps`` steps), and so is the fresh denominator ``sqrt(v_fresh) +
    eps`` of the correction factor: a coordinate that never gets a gradient has ``v_fresh ~ 0``
    too, so the elementwise maximum would sit at ``floor / eps`` and pin the factor at
    ``factor_max``. A non-finite step is skipped (state kept, ``state.skips``
    count it; more than ``max_consecutive_skips`` in a row raise): one whose update or
    variance is not finite (a NaN or Inf gradient on any device, or a finite one whose square
    overflows fp32), or whose sums overflow (the update's squares, entries above ~1e19 /
    sqrt(size); the variance's, a mean above ~3e38 / size).

    Options, off by default because they did not help on that task: ``bias_correction`` (``m /
    (1 - b1^t)``, ``v / (1 - b2^min(t, freeze_step))``, ``v_fresh / (1 - b2^t)``; LAMB's trust
    ratio cancels scalar corrections during the warm-up and the frozen coefficient is
    calibrated on the uncorrected update) and ``precondition`` (the 1-bit mean carries the local
    momenta divided by the frozen denominator, mapped back by it, instead of DeepSpeed's
    per-leaf scaling coefficients).

    Run length: the warm-up is ``freeze_step`` exact steps, or, given ``total_steps`` instead,
    ``round(0.15 * total_steps)`` (freezing the trust ratio and the variance earlier costs
    loss). One of the two is required: there is no constant default (DeepSpeed's is 100000
    steps of exact LAMB). After the freeze the step stays bounded by the frozen trust ratio
    (its correction factor is clipped to ``[factor_min, factor_max]``), so 1-bit LAMB needs no
    bound like :func:`onebit_adam`'s ``max_step_rms``.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps, weight_decay: as DeepSpeed's ``OnebitLamb`` (``weight_decay`` is L2 added to
        the update).
      freeze_step: number of exact warm-up updates, at least 1 (the frozen trust ratio comes
        from the warm-up; may be a traced int); default ``round(0.15 * total_steps)``.
      max_coeff, min_coeff: clip of the warm-up trust ratio.
      coeff_beta: EMA coefficient of the trust ratio (``1 / (1 - coeff_beta)`` should not
        exceed ``freeze_step``, DeepSpeed advises).
      factor_max, factor_min, factor_threshold: clips of the correction factor.
      axis_name: the data-parallel axis.
      total_steps: the run's length, for the default ``freeze_step``; one of the two is
        required.
      compressor: default ``jc.OneBit()``.
      bucket_bytes: bucket size of the momentum all-reduce (and the warm-up gradient mean);
        ``None``: one bucket.
      axis_size: devices on the axis, for ``init``.
      variance_floor: see above (default 0.1; ignored under ``deepspeed_compat``).
      deepspeed_compat: DeepSpeed's rules (no floor).
      max_consecutive_skips: non-finite steps in a row before the error (``None``: never).
      bias_correction, precondition: see above (default off).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> tx = jc.onebit_lamb(1e-3, axis_name="dp", total_steps=10, axis_size=2)  # 2 exact
      >>> params = {"w": jnp.ones(4)}
      >>> step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> updates, state = step({"w": jnp.ones((2, 4))}, state)
      >>> [round(float(u), 6) for u in updates["w"][0]]
      [-0.001, -0.001, -0.001, -0.001]

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`OneBitLambState`; ``comm`` is
      per device, the rest replicated. Parameters stay replicated.
    """
    config = lamb_config(
        b1,
        b2,
        eps,
        weight_decay,
        freeze_step,
        max_coeff,
        min_coeff,
        coeff_beta,
        factor_max,
        factor_min,
        factor_threshold,
        axis_name=axis_name,
        total_steps=total_steps,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        axis_size=axis_size,
        variance_floor=variance_floor,
        deepspeed_compat=deepspeed_compat,
        max_consecutive_skips=max_consecutive_skips,
        bias_correction=bias_correction,
        precondition=precondition,
    )

    def update_fn(updates, state, params=None):
        scale = -learning_rate_at(learning_rate, state.count)
        delta, new_state = lamb_update(config, scale, updates, state, params)
        return cast_like(delta, params), new_state

    return optax.GradientTransformation(partial(lamb_init, config), update_fn)


def lamb_config(
    b1,
    b2,
    eps,
    weight_decay,
    freeze_step,
    max_coeff,
    min_coeff,
    coeff_beta,
    factor_max,
    factor_min,
    factor_threshold,
    *,
    axis_name: AxisName,
    total_steps: int | None,
    compressor: Compressor | None,
    bucket_bytes: int | None,
    axis_size: int | None,
    variance_floor: float | None,
    deepspeed_compat: bool,
    max_consecutive_skips: int | None,
    bias_correction: bool,
    precondition: bool,
) -> LambConfig:
    """The checked :class:`LambConfig` of :func:`scale_by_onebit_lamb`'s arguments (ranges known
    at trace time, ``freeze_step >= 1``, the compressor), its defaults filled in."""
    compressor = OneBit() if compressor is None else compressor
    check_compressor(compressor)
    bucket_bytes = static_bucket_bytes(bucket_bytes)
    check_static_range("onebit_lamb", "b1", b1, 0.0, 1.0, high_open=True)  # g~ divides by 1 - b1
    check_static_range("onebit_lamb", "b2", b2, 0.0, 1.0)
    check_static_range("onebit_lamb", "coeff_beta", coeff_beta, 0.0, 1.0)
    check_static_range("onebit_lamb", "min_coeff", min_coeff, 0.0, low_open=True)
    check_static_range("onebit_lamb", "max_coeff", max_coeff, 0.0, low_open=True)
    check_static_range("onebit_lamb", "factor_min", factor_min, 0.0, low_open=True)
    check_static_range("onebit_lamb", "factor_max", factor_max, 0.0, low_open=True)
    check_static_range("onebit_lamb", "factor_threshold", factor_threshold, 0.0)
    for low, high, names in (
        (min_coeff, max_coeff, "min_coeff <= max_coeff"),
        (factor_min, factor_max, "factor_min <= factor_max"),
    ):
        if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
            raise ValueError(f"jaxcomm: onebit_lamb needs {names}, got {low!r} > {high!r}")
    freeze_step = resolve_freeze_step("onebit_lamb", freeze_step, total_steps)
    static_freeze = static_int(freeze_step)
    if static_freeze is not None and static_freeze < 1:
        raise ValueError(
            f"jaxcomm: onebit_lamb needs freeze_step >= 1 (the frozen LAMB coefficient is an "
            f"average over the warm-up), got {freeze_step!r}"
        )
    return LambConfig(
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        freeze_step=freeze_step,
        max_coeff=max_coeff,
        min_coeff=min_coeff,
        coeff_beta=coeff_beta,
        factor_max=factor_max,
        factor_min=factor_min,
        factor_threshold=factor_threshold,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        axis_size=axis_size,
        floor=None if deepspeed_compat else variance_floor,
        max_consecutive_skips=max_consecutive_skips,
        bias_correction=bool(bias_correction),  # both off by default (see onebit_lamb)
        precondition=bool(precondition),
    )


def lamb_init(config: LambConfig, params: PyTree) -> OneBitLambState:
    """The state before the first update: zero moments, ``coeff_freeze = 0``, factors and
    scaling coefficients 1, the compressor's error feedback."""
    n = resolve_axis_size(config.axis_name, config.axis_size)
    mu = zeros_f32(params)
    comm = init_state(config.compressor, mu, axis_size=n, bucket_bytes=config.bucket_bytes)
    comm = cast(ReduceState, comm)  # an all-reduce's state

    def scalars(value):
        return jax.tree.map(lambda _: jnp.full([], value, jnp.float32), params)

    return OneBitLambState(
        count=jnp.zeros([], jnp.int32),
        mu=mu,
        nu=zeros_f32(params),
        nu_fresh=zeros_f32(params),
        coeff_freeze=scalars(0.0),
        last_factor=scalars(1.0),
        scaling_coeff=scalars(1.0),
        comm=comm,
        skips=SkipCounters.zeros(),
        nu_mean=scalars(0.0),
    )


def lamb_update(config: LambConfig, scale, updates, state: OneBitLambState, params=None):
    """One update: each leaf's ``scale c u`` (``c u`` when ``scale`` is ``None``), fp32, zero on
    a skipped step, and the new state. The phase (``warm_up`` or ``compressed``, of
    :mod:`jaxcomm.optim._onebit_lamb_step`) is a ``lax.cond``, or the one branch of a
    phase-specialised step."""
    if params is None:
        raise ValueError(
            "jaxcomm: onebit_lamb needs params for the trust ratio: call "
            "update(grads, state, params)"
        )
    s = step_constants(config, state.count, params, scale)
    args = (f32(updates), state.mu, state.nu, state.nu_fresh, state.coeff_freeze)
    args += (state.last_factor, state.scaling_coeff, state.comm, state.nu_mean)
    freeze = config.freeze_step
    warm = phase(state.count < freeze, steady=steady_below(state.count, freeze))
    mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, delta, ok, nu_mean = phase_cond(
        warm, partial(warm_up, s), partial(compressed, s), *args
    )
    # A non-finite step (NaN/Inf in any device's gradient reaches the mean) is skipped:
    # moments, coefficients and factors stay, the collectives' guard kept the error feedback.
    # The phase's own probe covers what it changed (the update and the variance it divides
    # by; the state it passes through, a warm-up's nu_fresh or a compressed step's frozen nu,
    # is finite), replicated like them.
    skips = count_skips(ok, state.skips, config.max_consecutive_skips, "onebit_lamb")
    candidate = OneBitLambState(
        count=s.t,
        mu=mu,
        nu=nu,
        nu_fresh=nu_fresh,
        coeff_freeze=coeff_freeze,
        last_factor=last_factor,
        scaling_coeff=scaling,
        comm=comm,
        skips=skips,
        nu_mean=nu_mean,
    )
    comm = keep_error_feedback(
        ok, comm, state.comm, state.mu, config.compressor, config.bucket_bytes
    )
    candidate = candidate._replace(comm=comm)
    old = state._replace(comm=comm, skips=candidate.skips)
    return zeros_unless(ok, delta), keep_if(ok, candidate, old)
