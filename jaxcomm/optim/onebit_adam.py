"""DeepSpeed's 1-bit Adam: exact warm-up, then the 1-bit all-reduce of the momentum.

Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed" (arXiv:2102.02888). Two pieces, composed like optax's ``adamw``:

* :func:`scale_by_onebit_adam`: the direction ``m / (sqrt(v) + eps)`` (the communication,
  the moments and the variance freeze);
* :func:`onebit_adam`: that direction, then ``optax.add_decayed_weights(weight_decay)``, then
  ``-learning_rate``, cast to the parameters' dtype.

``onebit_adam`` applies the three pieces itself rather than returning ``optax.chain(...)``: a
chain's state is a tuple of three states, and the state of ``onebit_adam`` stays one
:class:`OneBitAdamState` (``state.mu``, ``state.comm``: checkpoints, ``inject_hyperparams`` and
:mod:`jaxcomm.train` reads it), and the learning rate is evaluated at the same ``count`` as the
moments (a chained ``scale_by_learning_rate`` keeps its own count). The result is bit for bit
the chain ``optax.chain(scale_by_onebit_adam(...), optax.add_decayed_weights(wd),
optax.scale_by_learning_rate(lr))`` for fp32 parameters (weight decay is taken on fp32 copies of
the parameters, so bf16 parameters lose no precision in ``wd * p``).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.comm.axes import AxisName
from jaxcomm.comm.packed import PackedMean, init_packed_mean, packed_mean_squares, unpack_mean
from jaxcomm.comm.state import ReduceState, init_state
from jaxcomm.compressors import Compressor, OneBit
from jaxcomm.fusion import kept_form
from jaxcomm.guard import SkipCounters, keep_if
from jaxcomm.optim._common import (
    PyTree,
    cast_like,
    check_compressor,
    compressed_mean_call,
    compressed_mean_or_fallback_call,
    compressed_mean_packed_call,
    exact_mean,
    f32,
    learning_rate_at,
    needs_params,
    resolve_axis_size,
    static_bucket_bytes,
    static_int,
    zeros_f32,
)
from jaxcomm.optim._moments import (
    apply_mask,
    clip_step_rms,
    damped_denominator,
    ema,
    resolve_freeze_step,
)
from jaxcomm.optim._skip import (
    all_finite,
    count_skips,
    floating_buckets,
    keep_error_feedback,
    mean_finite,
    zeros_unless,
)
from jaxcomm.optim.schedule import STEADY_FOREVER, phase, phase_cond, steady_below


class OneBitAdamState(NamedTuple):
    """State of :func:`scale_by_onebit_adam` and :func:`onebit_adam`.

    Attributes:
      count: updates done so far (int32 scalar, replicated).
      mu: first moment, fp32, replicated (the compressed all-reduce output is identical on every
        device).
      nu: second moment, fp32, replicated (frozen after ``freeze_step``).
      comm: error feedback of the 1-bit momentum all-reduce (per-device ``jc.ReduceState``).
      skips: the updates skipped because they were not finite, in a row and in all
        (:class:`~jaxcomm.guard.SkipCounters`, int32, replicated).
      preconditioned: whether ``mu`` and ``nu`` are in the step's space (bool, replicated):
        from the first compressed step on with ``precondition``, ``nu`` holds the frozen
        denominator ``d = max(sqrt(v_hat), floor * rms) + eps`` and ``mu`` the preconditioned
        momentum ``m / d`` (Adam's first moment is ``mu * nu``, its ``v_hat`` is ``(nu -
        eps)**2`` where the floor did not bind).
      mean_wire: ``mu`` as the 1-bit all-reduce sent it (:class:`jaxcomm.PackedMean`:
        packed signs and scales, about 1/32 of ``mu``'s bytes, replicated), which the
        compressed steps read instead of ``mu`` on GPU (where the decode fuses into its
        readers; elsewhere they read ``mu``); ``mean_wire.valid`` is false until the first
        compressed step and after a resize, when the step reads ``mu`` once. Empty for a
        compressor without a packed mean, a tuple of axes or a ``momentum_mask``.
    """

    count: jax.Array
    mu: PyTree
    nu: PyTree
    comm: ReduceState
    skips: SkipCounters
    preconditioned: jax.Array
    mean_wire: PackedMean


def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    freeze_step: int | None = None,
    *,
    axis_name: AxisName,
    total_steps: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    bias_correction: bool | None = None,
    variance_floor: float | None = 0.1,
    momentum_mask: PyTree | None = None,
    deepspeed_compat: bool = False,
    max_consecutive_skips: int | None = 16,
    precondition: bool | None = None,
    max_step_rms: float | None = 1.0,
) -> optax.GradientTransformation:
    """1-bit Adam's direction ``m / (sqrt(v) + eps)`` from this device's local gradients.

    With ``t = count + 1`` the 1-based step and ``g_r`` this device's gradient:

    * warm-up, the first ``freeze_step`` updates (``count < freeze_step``): ``g = mean_r g_r``
      exactly; ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    * compression, from update ``freeze_step`` on: ``m = b1 m + (1-b1) g_r`` locally, then
      ``m = OneBit-mean_r(m)`` (worker and server error feedback); ``v`` stays frozen;
    * both: the returned direction is ``m / (sqrt(v) + eps)``, fp32, identical on every device;
      after the freeze ``sqrt(v)`` is damped (``variance_floor``) and ``m`` masked
      (``momentum_mask``), see :func:`onebit_adam`.

    ``bias_correction`` (default on, off under ``deepspeed_compat``) uses ``m / (1 - b1^t)`` and
    ``v / (1 - b2^tv)`` with ``tv = min(t, freeze_step)``, the step at which ``v`` was last
    updated. After the freeze each leaf's direction is bounded in RMS by ``max_step_rms``. A step
    whose result is not finite is skipped (see :func:`onebit_adam`). Chain it like
    ``optax.scale_by_adam``: ``optax.chain(jc.scale_by_onebit_adam(axis_name="dp",
    total_steps=1000),
    optax.add_decayed_weights(1e-2), optax.scale_by_learning_rate(1e-3))``. The arguments are
    those of :func:`onebit_adam`.
    """
    compressor = OneBit() if compressor is None else compressor
    check_compressor(compressor)
    bucket_bytes = static_bucket_bytes(bucket_bytes)
    freeze_step = resolve_freeze_step("onebit_adam", freeze_step, total_steps)
    if isinstance(max_step_rms, int | float) and not max_step_rms > 0:
        raise ValueError(
            f"jaxcomm: onebit_adam max_step_rms must be > 0 or None, got {max_step_rms!r}"
        )
    static_freeze = static_int(freeze_step)
    if bias_correction is None:
        bias_correction = not deepspeed_compat
    floor = None if deepspeed_compat else variance_floor
    precondition = not deepspeed_compat if precondition is None else precondition
    max_step_rms = None if deepspeed_compat else max_step_rms

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        mu = zeros_f32(params)
        comm = init_state(compressor, mu, axis_size=n, bucket_bytes=bucket_bytes)
        # Distinct arrays for the counters (one shared buffer cannot be donated three times).
        count, skips = jnp.zeros([], jnp.int32), SkipCounters.zeros()
        in_step_space = jnp.zeros([], jnp.bool_)
        wire = (
            init_packed_mean(mu, compressor, bucket_bytes, axis_name, n)
            if momentum_mask is None
            else PackedMean((), jnp.zeros([], jnp.bool_))
        )
        return OneBitAdamState(count, mu, zeros_f32(params), comm, skips, in_step_space, wire)

    def update_fn(updates, state, params=None):
        del params
        grads = f32(updates)
        b1_, b2_ = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)

        t = optax.safe_increment(state.count)
        eps_ = jnp.asarray(eps, jnp.float32)
        one = jnp.ones([], jnp.float32)
        c1, c2 = one, one
        if bias_correction:
            tv = jnp.maximum(jnp.minimum(t, freeze_step), 1).astype(jnp.float32)
            c1 = 1 - b1_ ** t.astype(jnp.float32)
            c2 = 1 - b2_**tv

        def denominator(nu, frozen):
            """``sqrt(v_hat) + eps``, damped after the freeze (``variance_floor``). The leaf's
            mean is taken of ``v`` itself, so that ``v / c2`` is not materialised."""
            return jax.tree.map(
                lambda v: damped_denominator(v, eps_, floor, scale=c2, enabled=frozen), nu
            )

        packs = momentum_mask is None and bool(state.mean_wire.buckets)
        frozen, in_step_space, from_wire = _phases(
            state, freeze_step, static_freeze, precondition=precondition, packs=packs
        )

        # Known compressed with no mask: the mean is the new momentum, and the collective falls
        # back to the old one itself when not finite (no select pass over the tree). With one
        # bucket that is the whole skip; with several, a bucket may fall back alone.
        mean_is_momentum = frozen is True and momentum_mask is None
        fallback_is_skip = (
            mean_is_momentum and floating_buckets(state.mu, compressor, bucket_bytes) <= 1
        )

        def frozen_denominator(in_step_space):
            """``d`` after the freeze: ``nu`` itself once in the step's space, else from ``v``."""
            if in_step_space is True:
                return state.nu
            fresh = denominator(state.nu, True)
            if in_step_space is False:
                return fresh
            return jax.tree.map(lambda d, f: jnp.where(in_step_space, d, f), state.nu, fresh)

        # Only the communication is in the lax.cond; the moments are updated after it, in their
        # own donated buffers (XLA copies a state that passes through a lax.cond).
        def warm(g, mu, comm):
            mean = exact_mean(g, axis_name, bucket_bytes)
            return mean, comm, all_finite(mean)

        def compress(g, mu, comm, in_step_space=False):
            """The compressed mean of the momentum updated from ``mu`` (the fallback too)."""
            if precondition:
                # Compress m / d, what the step applies: its magnitudes are even across
                # coordinates, so one 1-bit scale fits them. In the step's space m is mu * d.
                def local_step(m, x, d):
                    return (b1_ * jnp.where(in_step_space, m * d, m) + (1 - b1_) * x) / d

                local = jax.tree.map(local_step, mu, g, frozen_denominator(in_step_space))
            else:
                local = ema(mu, g, b1_)  # in the branch, so that it fuses into the 1-bit pass
            if mean_is_momentum and packs:  # and the mean before the fallback, and as sent
                return compressed_mean_packed_call(
                    local, comm, mu, axis_name, compressor, bucket_bytes
                )
            if mean_is_momentum:  # and the mean before the fallback, last
                return (
                    *compressed_mean_or_fallback_call(
                        local, comm, mu, axis_name, compressor, bucket_bytes, return_fresh=True
                    ),
                    None,
                )
            mean, new = compressed_mean_call(local, comm, axis_name, compressor, bucket_bytes)
            return mean, new, mean_finite(mean, comm, new, axis_name, compressor=compressor)

        # One compressed branch, for both spaces (one collective chain in the program).
        compress_here = partial(compress, in_step_space=in_step_space)
        # The momentum the step starts from (and keeps when skipped): mu, or on GPU the same
        # values decoded from the packed mean, where the decode fuses into its readers
        # (XLA:CPU decodes a packed byte per element unvectorised: slower than reading mu).
        prev = state.mu
        if from_wire:

            def decoded():
                return unpack_mean(state.mean_wire, state.mu, compressor, bucket_bytes)

            prev = kept_form(state.mu, decoded)
        fresh = packed = None  # the 1-bit mean as decoded before the fallback, and as sent
        if mean_is_momentum:  # known compressed: no conditional, the branch itself
            mean, comm, ok, fresh, packed = compress_here(grads, prev, state.comm)
        else:
            mean, comm, ok = phase_cond(frozen, compress_here, warm, grads, state.mu, state.comm)
        # warm-up: mean = the exact mean gradient g, m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2;
        # after: mean = the 1-bit mean of the (preconditioned) momentum, m = mask(mean), v
        # frozen (d in the step's space).
        mu = jax.tree.map(
            lambda masked, x, m: jnp.where(frozen, masked, b1_ * m + (1 - b1_) * x),
            apply_mask(mean, momentum_mask),
            mean,
            state.mu,
        )
        nu_frozen = frozen_denominator(in_step_space) if precondition else state.nu
        nu = jax.tree.map(
            lambda f, v, x: jnp.where(frozen, f, b2_ * v + (1 - b2_) * x**2),
            nu_frozen,
            state.nu,
            mean,
        )
        # A non-finite mean (NaN/Inf on any device) skips the step: moments and error feedback
        # stay, nothing moves. The step is taken of the kept moments (else XLA copies mu, nu).
        mu = mu if fallback_is_skip else keep_if(ok, mu, prev)
        nu = keep_if(ok, nu, state.nu)
        comm = keep_error_feedback(ok, comm, state.comm, state.mu, compressor, bucket_bytes)
        if not precondition:
            step = jax.tree.map(lambda m, den: (m / c1) / den, mu, denominator(nu, frozen))
        elif frozen is True:
            # The step's RMS and the update read the mean again from the 1-bit message (its
            # decode fuses into them), not the momentum just written; where the mean is not
            # finite the step is zero (ok is false), so the fallback never reaches it.
            step = jax.tree.map(lambda m: m / c1, mu if fresh is None else fresh)
        else:
            step = jax.tree.map(  # after the freeze: divided by 1
                lambda m, den: (m / c1) / jnp.where(frozen, one, den), mu, denominator(nu, frozen)
            )
        # After the freeze, each leaf's step is bounded in RMS (max_step_rms, see onebit_adam).
        # Where the step is the 1-bit mean, its RMS comes from the message's scales: a
        # reduction of the decoded step would read it whole (on CPU: write it, then read it).
        squares = None
        if frozen is True and fresh is not None and packed is not None and precondition:
            squares = packed_mean_squares(packed, state.mu, compressor, bucket_bytes)
        if squares is None:
            step = jax.tree.map(lambda x: clip_step_rms(x, max_step_rms, frozen), step)
        else:
            step = jax.tree.map(
                lambda x, sq: clip_step_rms(x, max_step_rms, frozen, mean_square=sq / c1**2),
                step,
                squares,
            )
        direction = zeros_unless(ok, step)
        skips = count_skips(ok, state.skips, max_consecutive_skips, "onebit_adam")
        new_state = OneBitAdamState(
            jnp.where(ok, t, state.count),
            mu,
            nu,
            comm,
            skips,
            jnp.where(ok, jnp.asarray(frozen) & precondition, state.preconditioned),
            _next_wire(state.mean_wire, packed, ok),
        )
        return direction, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _phases(state: OneBitAdamState, freeze_step, static_freeze, *, precondition: bool, packs: bool):
    """``(frozen, in_step_space, from_wire)`` of this step, from the state's phase.

    Phases: 0 warm-up; 1 compressed from the dense momentum (from Adam's moments the first
    time; in the step's space after a resize); 2 compressed in the step's space (``mu = m /
    d``, ``nu = d`` from the first compressed step on, so the 1-bit mean is the new ``mu``),
    from the packed mean of the previous step where the compressor has one (``packs``).
    Without preconditioning or a packed mean, kind 1 is the only compressed kind. Python
    values when static or phase-specialised: only their branches are traced.
    """
    staged = precondition or packs
    ready = jnp.asarray(state.preconditioned | (not precondition))
    if packs:
        ready = ready & state.mean_wire.valid
    if static_freeze is not None and static_freeze <= 0:  # no warm-up branch at all
        frozen = True
        # Ready after the first step that is not skipped, then for good.
        moved = jnp.where(ready, STEADY_FOREVER, 0)
        steady_kind = phase(ready, steady=moved) if staged else False
    else:
        compressed = 1 + ready.astype(jnp.int32) if staged else 1
        cases = 3 if staged else 2
        # Warm-up until the count reaches freeze_step; kind 1 lasts one (unskipped) step.
        steady = steady_below(state.count, freeze_step)
        if staged:
            held = ready | (state.count < freeze_step)
            steady = jnp.where(held, steady, 0)
        kind = phase(jnp.where(state.count >= freeze_step, compressed, 0), cases, steady=steady)
        frozen = kind >= 1
        steady_kind = kind == 2
    if not precondition:
        in_step_space = False
    else:  # the steady kind is in the step's space; before it, as the state says
        in_step_space = True if steady_kind is True else state.preconditioned
    # The previous mean from its packed form: read where it is used, 1/32 of the bytes.
    return frozen, in_step_space, packs and steady_kind is True


def _next_wire(wire: PackedMean, packed, ok: jax.Array) -> PackedMean:
    """The packed mean after a step that sent ``packed`` (``None``: sent none) with verdict
    ``ok``: the new mean as sent, kept with the momentum when skipped; a step that moves the
    momentum without sending it leaves the packed mean behind (not valid)."""
    if packed is None:
        return wire._replace(valid=~ok & wire.valid)
    return PackedMean(keep_if(ok, packed, wire.buckets), ok | wire.valid)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int | None = None,
    *,
    axis_name: AxisName,
    total_steps: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    bias_correction: bool | None = None,
    variance_floor: float | None = 0.1,
    momentum_mask: PyTree | None = None,
    deepspeed_compat: bool = False,
    max_consecutive_skips: int | None = 16,
    precondition: bool | None = None,
    max_step_rms: float | None = 1.0,
) -> optax.GradientTransformation:
    """DeepSpeed's 1-bit Adam (``OnebitAdam``) as an optax transformation over local gradients.

    :func:`scale_by_onebit_adam`'s direction ``d = m / (sqrt(v) + eps)`` (see there for the
    warm-up and compression rules), then ``update = d + weight_decay * p``; the returned optax
    update is ``-lr(count) * update`` in each parameter's dtype (apply it with
    ``optax.apply_updates``).

    Safe defaults (chosen on a byte-level transformer LM, ``benchmarks/convergence.py``, where
    DeepSpeed's rules diverge); ``deepspeed_compat=True`` restores DeepSpeed's rules exactly
    (tested against a NumPy model of them):

    * **bias correction** (DeepSpeed has none): ``m / (1 - b1^t)``, ``v / (1 - b2^tv)``. Without
      it the variance frozen after ``T`` warm-up steps is ``1 - b2^T`` of its value
      (``1 - 0.999^115 = 0.11`` at ``T = 115``), so every compressed step is about
      ``1 / sqrt(0.11) = 3`` times Adam's.
    * **variance floor**: after the freeze the denominator is ``max(sqrt(v_hat), variance_floor
      * sqrt(mean_leaf(v_hat))) + eps`` per leaf. Coordinates whose gradient was (near) zero
      during the warm-up (embedding rows of tokens never or rarely seen, the key part of an
      attention bias, whose gradient is exactly 0) would otherwise turn the non-zero momentum
      that 1-bit compression hands them (a scale times a sign: 1-bit cannot say 0) into
      ``m / eps`` steps: the blow-up to ``|p| ~ 1e3``. The floor 0.1 keeps the task's max
      ``|p|`` at Adam's; ``None`` disables it. ``momentum_mask`` (DeepSpeed's ``exp_avg_mask``,
      0/1 per coordinate, multiplied into the mean momentum) is the manual alternative.
    * **preconditioned compression** (``precondition``, default on, off under
      ``deepspeed_compat``): after the freeze the 1-bit all-reduce carries ``m / denom`` (the
      step itself) instead of ``m`` (``denom`` is frozen and identical on every device, so
      this is exact without compression); the error feedback lives in that space, and so do
      the moments from the first compressed step on (``state.mu = m / denom``, ``state.nu =
      denom``, ``state.preconditioned``): the mean is the new ``mu``, with no pass mapping it
      back. Adam's steps have even magnitudes across coordinates, momenta do not: one 1-bit
      scale fits the first far better (see ``benchmarks/convergence.py``).
    * **bounded step after the freeze** (``max_step_rms``, default 1.0; ignored under
      ``deepspeed_compat``): each leaf's direction ``d`` is scaled by ``min(1, max_step_rms /
      rms(d))``, ``rms`` over the leaf. Under stationary gradients Adam's step has a mean
      square of at most 1 per coordinate (``E[m^2] <= E[g^2] = v``); a frozen ``v`` does not
      follow gradients that grow after the freeze (a short warm-up early in training), and the
      step then grows with them until the loss is NaN. Measured: exact Adam with ``v`` frozen
      after 2-10 steps diverges that way on a GPT-style LM and an MLP regression, with or without
      1-bit compression (``tests/optim/test_onebit_stability.py``); bounded, both train like
      Adam. Where the bound does not bind the factor is exactly 1 (the step is unchanged).
    * **non-finite steps are skipped**: if the mean gradient or momentum is not finite (a NaN
      or Inf on any device), nothing changes (moments kept; the collectives' guard keeps the
      error feedback) and ``state.skips`` counts it; after more than
      ``max_consecutive_skips`` (16) in a row the step raises ``FloatingPointError``
      (inside JAX's runtime error). Like ``optax.apply_if_finite``, for every device at once.
      With several buckets (``bucket_bytes``) the skip is exact too: every bucket's error
      feedback is kept, not only the non-finite bucket's (a select over the error feedback
      per step, which one bucket, the default, does not need).

    Differences from DeepSpeed, on purpose: DeepSpeed's first ``step()`` only allocates buffers
    (so it runs ``freeze_step - 1`` real warm-up updates); here every call is an update and
    there are exactly ``freeze_step`` warm-up updates. The error feedback is part of the state,
    so it survives checkpoints (DeepSpeed drops it on load). DeepSpeed compresses each parameter
    tensor separately: ``bucket_bytes=1`` does the same (one bucket per leaf); the default
    ``None`` compresses all parameters as one bucket (one collective chain, one scale).

    Run length: the warm-up is ``freeze_step`` exact steps, or, given ``total_steps`` instead,
    ``round(0.15 * total_steps)`` (the paper's and DeepSpeed's advice: the variance must have
    settled; a shorter warm-up costs more than compression does). One of the two is required:
    there is no constant default (DeepSpeed's is 100000 steps of exact Adam).
    ``bucket_bytes=1`` gives each tensor its own 1-bit scale.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps, weight_decay: as DeepSpeed's ``OnebitAdam`` (``weight_decay`` is L2 added to
        the update, so ``update`` needs ``params`` when it is non-zero).
      freeze_step: number of exact warm-up updates (may be a traced int); default
        ``round(0.15 * total_steps)``.
      axis_name: the data-parallel axis.
      total_steps: the run's length, for the default ``freeze_step``; one of the two is
        required.
      compressor: default ``jc.OneBit()``; ``jc.NoCompression()`` makes it exact Adam with v
        frozen after ``freeze_step``.
      bucket_bytes: bucket size of the momentum all-reduce (and the warm-up gradient mean).
      axis_size: devices on the axis, for ``init``.
      bias_correction: default ``not deepspeed_compat``.
      variance_floor: see above (default 0.1; ignored under ``deepspeed_compat``).
      momentum_mask: optional 0/1 tree like the parameters (DeepSpeed's ``exp_avg_mask``).
      deepspeed_compat: DeepSpeed's rules (no bias correction, floor, preconditioning or
        step bound).
      max_consecutive_skips: non-finite steps in a row before the error (``None``: never, and
        no host callback per step).
      precondition: default ``not deepspeed_compat`` (see above).
      max_step_rms: the bound on each leaf's RMS step after the freeze, in units of the
        learning rate (default 1.0; ``None`` disables it; ignored under ``deepspeed_compat``).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> tx = jc.onebit_adam(1e-3, axis_name="dp", total_steps=10, axis_size=2)  # 2 exact
      >>> params = {"w": jnp.ones(4)}
      >>> step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> updates, state = step({"w": jnp.ones((2, 4))}, state)
      >>> [round(float(u), 6) for u in updates["w"][0]]
      [-0.001, -0.001, -0.001, -0.001]

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`OneBitAdamState`; ``mu`` and
      ``nu`` are replicated, ``comm`` per device. Parameters stay replicated.
    """
    direction = scale_by_onebit_adam(
        b1,
        b2,
        eps,
        freeze_step,
        axis_name=axis_name,
        total_steps=total_steps,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        axis_size=axis_size,
        bias_correction=bias_correction,
        variance_floor=variance_floor,
        momentum_mask=momentum_mask,
        deepspeed_compat=deepspeed_compat,
        max_consecutive_skips=max_consecutive_skips,
        precondition=precondition,
        max_step_rms=max_step_rms,
    )
    decay = optax.add_decayed_weights(weight_decay)

    def update_fn(updates, state, params=None):
        needs_params(params, weight_decay, "onebit_adam")
        d, new_state = direction.update(updates, state, params)
        if params is not None:
            d, _ = decay.update(d, decay.init(params), f32(params))
        lr = learning_rate_at(learning_rate, state.count)
        applied = new_state.skips.consecutive == 0  # a skipped step moves nothing, no decay
        out = jax.tree.map(lambda x: jnp.where(applied, -lr * x, jnp.zeros_like(x)), d)
        return cast_like(out, updates if params is None else params), new_state

    return optax.GradientTransformation(direction.init, update_fn)
