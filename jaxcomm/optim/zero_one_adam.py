"""DeepSpeed's 0/1 Adam: adaptive variance freezing and 1-bit synchronisation of local steps.

Lu et al., 2022, "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam"
(arXiv:2202.06009). Two pieces, in the shape of :mod:`jaxcomm.optim.onebit_adam`:

* :func:`scale_by_zero_one_adam`: the parameter change of a step, fp32 (the communication, the
  moments, the local steps, the schedules), in one :class:`ZeroOneAdamState`;
* :func:`zero_one_adam`: that change in each parameter's dtype.

The learning rate cannot be split out of the first: a synchronisation step un-does the local
parameter updates of the last interval and applies their 1-bit mean, and both are sums of
``lr * update`` over the interval (``u`` and ``lrs``). The kind of each step
(:func:`jaxcomm.optim._zero_one_step.step_kind`), what each kind communicates and does, and
the interval policies are named functions of :mod:`jaxcomm.optim._zero_one_step`; the skip of a
non-finite step is in ``_skip``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.comm.axes import AxisName, canonical_axis
from jaxcomm.comm.state import ReduceState, init_state, per_device
from jaxcomm.compressors import Compressor, OneBit
from jaxcomm.guard import SkipCounters, keep_if
from jaxcomm.optim._common import (
    PyTree,
    cast_like,
    check_compressor,
    f32,
    is_static_zero,
    learning_rate_at,
    needs_params,
    resolve_axis_size,
    static_bucket_bytes,
    unzip,
    varying,
    zeros_f32,
)
from jaxcomm.optim._moments import ema, leaf_mean
from jaxcomm.optim._skip import all_finite, count_skips, keep_error_feedback, on_every_device
from jaxcomm.optim._zero_one_step import ZeroOneStep, intervals, step_kind


@per_device(_blocks=True)
class LocalState(NamedTuple):
    """0/1 Adam's per-device leaves (they differ between devices between synchronisations).

    Attributes:
      mu: first moment, fp32, shaped like the parameters (inside ``jc.local_view``: as
        ``(1, *shape)`` blocks, which :func:`zero_one_adam` updates in place).
      u: accumulated local updates since the last synchronisation (DeepSpeed's
        ``momentum_accumulator``), fp32, shaped like ``mu``.
    """

    mu: PyTree
    u: PyTree


@per_device(params=True)
class ZeroOneAdamState(NamedTuple):
    """State of :func:`scale_by_zero_one_adam` and :func:`zero_one_adam`. Scalars are
    replicated int32/fp32.

    Attributes:
      count: updates done so far.
      var_interval: steps between variance updates (doubles every ``var_update_scaler``).
      var_counter: variance updates since ``var_interval`` last doubled.
      local_interval: steps between synchronisations after the variance freeze.
      local_counter: frozen-stage steps since ``local_interval`` last doubled.
      lrs: sum of the learning rates since the last synchronisation.
      nu: second moment, fp32, replicated.
      local: per-device :class:`LocalState` (momentum and accumulated local updates).
      comm: per-device error feedback (``jc.ReduceState``), shared by the 1-bit gradient
        all-reduce and the 1-bit all-reduce of the accumulated updates; zeroed at the freeze.
      var_updates: steps covered by the updates of ``nu`` so far, its bias correction is
        ``1 - b2^var_updates`` (each update covers ``var_interval`` steps with
        ``interval_weighted_variance``, else one).
      skips: the updates skipped because they were not finite, in a row and in all
        (:class:`~jaxcomm.guard.SkipCounters`).
      nu_mean: each leaf's mean of ``nu`` (fp32 scalars, replicated), taken when ``nu`` is
        updated: the damped denominators (``variance_floor``) of the steps that do not update
        ``nu`` read it instead of a pass over ``nu``.
    """

    count: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_interval: jax.Array
    local_counter: jax.Array
    lrs: jax.Array
    nu: PyTree
    local: LocalState
    comm: ReduceState
    var_updates: jax.Array
    skips: SkipCounters
    nu_mean: PyTree


#: Fractions of ``total_steps`` behind 0/1 Adam's run-length defaults (see :func:`schedule_for`).
VAR_FREEZE_FRACTION = 0.15
LOCAL_SCALER_OF_FREEZE = 1 / 3
#: jaxcomm's default cap of the local-step interval (DeepSpeed's is 16; see :func:`zero_one_adam`).
SAFE_LOCAL_STEP_CLIPPER = 2


def schedule_for(
    total_steps: int | None, var_freeze_step: int | None, local_step_scaler: int | None
) -> tuple[int, int]:
    """0/1 Adam's ``(var_freeze_step, local_step_scaler)``: the given values, else from
    ``total_steps``, else DeepSpeed's constants (100000 and 32678, made for 100k+-step runs).

    From ``total_steps = T``: ``var_freeze_step = round(0.15 T)`` (the variance freezes after
    the same share of the run as 1-bit Adam's warm-up given ``total_steps``) and
    ``local_step_scaler = round(var_freeze_step / 3)`` (DeepSpeed's own ratio, 32678 / 100000),
    at least 1.
    """
    if total_steps is not None:
        total = int(total_steps)
        if total < 1:
            raise ValueError(f"jaxcomm: zero_one_adam total_steps must be >= 1, got {total_steps}")
        if var_freeze_step is None:
            var_freeze_step = max(1, round(VAR_FREEZE_FRACTION * total))
        if local_step_scaler is None:
            local_step_scaler = max(1, round(LOCAL_SCALER_OF_FREEZE * int(var_freeze_step)))
    if var_freeze_step is None:
        var_freeze_step = 100000
    if local_step_scaler is None:
        local_step_scaler = 32678
    return var_freeze_step, local_step_scaler


def scale_by_zero_one_adam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int | None = None,
    var_update_scaler: int = 16,
    local_step_scaler: int | None = None,
    local_step_clipper: int | None = None,
    *,
    axis_name: AxisName,
    total_steps: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    bias_correction: bool | None = None,
    variance_floor: float | None = 0.1,
    deepspeed_compat: bool = False,
    max_consecutive_skips: int | None = 16,
    precondition: bool | None = None,
    interval_weighted_variance: bool | None = None,
    compress_momentum: bool | None = None,
) -> optax.GradientTransformation:
    """0/1 Adam's parameter change from this device's local gradients, fp32, per device.

    With ``t = count + 1`` the 1-based step (DeepSpeed defaults in brackets):

    * variance stage, ``t <= var_freeze_step`` (100000): if ``t % var_interval == 0`` the exact
      mean gradient ``g`` updates both moments, ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2)
      g^2``; otherwise the 1-bit mean of the local gradients updates ``m`` only. Then
      ``update = m / (sqrt(v) + eps) + weight_decay * p``, ``p -= lr * update``. After a
      variance update, ``var_counter += 1``; when it reaches ``var_update_scaler`` (16) it resets
      and ``var_interval`` doubles.
    * at the first frozen step both error buffers are zeroed.
    * frozen stage, ``t > var_freeze_step``: ``m = b1 m + (1-b1) g_r`` from the local gradient;
      ``lrs += lr``; ``p -= lr * update``; ``u -= lr * update``. If ``t % local_interval == 0``
      (a synchronisation): ``p -= u``; ``u *= sqrt(v) + eps``; ``u = OneBit-mean(u)``;
      ``m = -u / lrs``; ``p += u / (sqrt(v) + eps)``; ``u = 0``; ``lrs = 0``. Then
      ``local_counter += 1``; when it reaches ``local_step_scaler`` (32678) it resets and
      ``local_interval = min(local_step_clipper (16), 2 * local_interval)``.

    The learning rate and the weight decay are arguments (the local steps' ``lr * update`` are
    summed in ``u``, a synchronisation divides by the summed rates): the change already holds
    ``-lr``, and :func:`zero_one_adam` is this in the parameters' dtype, with nothing chained
    after it. A skipped step's change is zero. The arguments are those of
    :func:`zero_one_adam`, whose notes (per-device parameters, safe defaults) hold here too.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> tx = jc.scale_by_zero_one_adam(1e-3, axis_name="dp", total_steps=100, axis_size=2)
      >>> params = {"w": jnp.ones(4)}
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")
      >>> updates, state = step({"w": jnp.ones((2, 4))}, state)  # a variance update: exact
      >>> [round(float(u), 6) for u in updates["w"][0]]  # -lr m_hat / (sqrt(v_hat) + eps)
      [-0.001, -0.001, -0.001, -0.001]
    """
    compressor = OneBit() if compressor is None else compressor
    check_compressor(compressor)
    bucket_bytes = static_bucket_bytes(bucket_bytes)
    var_freeze_step, local_step_scaler = schedule_for(
        total_steps, var_freeze_step, local_step_scaler
    )
    if local_step_clipper is None:
        local_step_clipper = 16 if deepspeed_compat else SAFE_LOCAL_STEP_CLIPPER
    scalers = (var_update_scaler, local_step_scaler, local_step_clipper)
    if bias_correction is None:
        bias_correction = not deepspeed_compat
    floor = None if deepspeed_compat else variance_floor
    precondition = not deepspeed_compat if precondition is None else precondition
    if compress_momentum is None:
        compress_momentum = not deepspeed_compat
    if interval_weighted_variance is None:
        interval_weighted_variance = not deepspeed_compat

    axis_name = canonical_axis(axis_name)

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        zeros = zeros_f32(params)
        comm = init_state(compressor, zeros, axis_size=n, bucket_bytes=bucket_bytes)
        one = jnp.ones([], jnp.int32)
        zero = jnp.zeros([], jnp.int32)
        return ZeroOneAdamState(
            count=zero,
            var_interval=one,
            var_counter=zero,
            local_interval=one,
            local_counter=zero,
            lrs=jnp.zeros([], jnp.float32),
            nu=zeros_f32(params),
            local=LocalState(mu=zeros, u=zeros_f32(params)),
            comm=comm,
            var_updates=jnp.zeros([], jnp.int32),
            skips=SkipCounters.zeros(),
            nu_mean=jax.tree.map(lambda _: jnp.zeros([], jnp.float32), params),
        )

    def update_fn(updates, state, params=None):
        needs_params(params, weight_decay, "zero_one_adam")
        t = optax.safe_increment(state.count)
        kind, first_sync, frozen, var_step = step_kind(t, state, var_freeze_step)
        b1_, b2_ = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
        # Steps covered by nu's updates: one each, or var_interval each (interval-weighted).
        weight = state.var_interval if interval_weighted_variance else 1
        var_updates = state.var_updates + jnp.where(~frozen & var_step, weight, 0).astype(jnp.int32)
        b2_var = b2_
        if interval_weighted_variance:
            b2_var = b2_ ** state.var_interval.astype(jnp.float32)
        one = jnp.ones([], jnp.float32)
        c1 = 1 - b1_ ** t.astype(jnp.float32) if bias_correction else one
        c2 = 1 - b2_ ** jnp.maximum(var_updates, 1).astype(jnp.float32) if bias_correction else one
        step = ZeroOneStep(
            b1=b1_,
            b2=b2_,
            b2_var=b2_var,
            eps=jnp.asarray(eps, jnp.float32),
            wd=jnp.asarray(weight_decay, jnp.float32),
            lr=learning_rate_at(learning_rate, state.count),
            t=t,
            var_freeze_step=var_freeze_step,
            c1=c1,
            c2=c2,
            first_sync=first_sync,
            floor=floor,
            precondition=precondition,
            compress_momentum=compress_momentum,
            # Without weight decay the step does not read p: an extra reader of the parameters
            # (which the step writes in place) makes XLA copy them first.
            params=None if params is None or is_static_zero(weight_decay) else f32(params),
            axis_name=axis_name,
            compressor=compressor,
            bucket_bytes=bucket_bytes,
            nu_means=state.nu_mean,
        )
        g = f32(updates)
        mu, u = varying(state.local.mu, axis_name), varying(state.local.u, axis_name)
        mean, comm, mean_ok = step.communicate(kind, g, mu, state.nu, u, state.comm)
        # A non-finite gradient or mean on any device skips the step on every device (one
        # int32 pmin; local steps would otherwise let the devices' schedules drift apart):
        # moments, local updates and schedules stay, the collectives' guard kept the error
        # feedback. A float sum over g (see all_finite); the mean's from its branch. A
        # phase-specialised step whose mean is of g itself (exact, kind 0) or of a buffer that
        # holds it, through a compressor whose guard a non-finite input always trips (OneBit:
        # its scale is the buffer's L2 norm; kinds 1 and 3) needs no pass over g of its own.
        covered = isinstance(kind, int) and (
            kind == 0 or (kind in (1, 3) and getattr(compressor, "output_decides_finite", False))
        )
        ok = on_every_device((True if covered else all_finite(g)) & mean_ok, axis_name)
        skips = count_skips(ok, state.skips, max_consecutive_skips, "zero_one_adam")
        # The new variance first (the denominators of this step read it).
        nu, nu_mean = new_variance(kind, ok, state, mean, step.b2_var)
        lrs_sync = state.lrs + step.lr  # the learning rates summed over the local steps
        leaves = jax.tree.map(
            lambda g_, m, v, vm, a, x, p: step.apply_leaf(
                kind, ok, g_, m, v, vm, a, x, p, lrs_sync
            ),
            g,
            mu,
            nu,
            nu_mean,
            u,
            mean,
            step.params_or_none(g),
        )
        new_mu, new_u, delta = unzip(leaves, g, 3)
        lrs = jnp.where(kind == 2, lrs_sync, jnp.where(kind == 3, 0.0, state.lrs))
        comm = keep_error_feedback(ok, comm, state.comm, g, compressor, bucket_bytes)
        candidate = ZeroOneAdamState(
            count=t,
            lrs=lrs.astype(jnp.float32),
            nu=nu,
            local=LocalState(mu=new_mu, u=new_u),
            comm=comm,
            var_updates=var_updates,
            skips=skips,
            nu_mean=nu_mean,
            **intervals(state, t, frozen, var_step, scalers),
        )
        # Moments, variance and local updates already kept their old values when not ok;
        # the scalars (count, schedules) are kept here.
        old_scalars = state._replace(
            nu=nu,
            nu_mean=nu_mean,
            local=candidate.local,
            comm=comm,
            skips=candidate.skips,
        )
        new_state = keep_if(ok, candidate, old_scalars)
        return delta, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def new_variance(kind, ok, state: ZeroOneAdamState, mean: PyTree, b2_var) -> tuple:
    """``(nu, nu_mean)`` after this step: kind 0 updates ``nu`` from the exact mean (written
    over it in place) and takes its leaf means; the other kinds keep both (a phase-specialised
    step that cannot update ``nu`` reads the kept means, no pass over ``nu``)."""
    updates = ok & (kind == 0)
    nu = jax.tree.map(lambda v, x: jnp.where(updates, ema(v, x, b2_var, 2), v), state.nu, mean)
    if isinstance(kind, int) and kind != 0:
        return nu, state.nu_mean
    nu_mean = jax.tree.map(lambda v, old: jnp.where(updates, leaf_mean(v), old), nu, state.nu_mean)
    return nu, nu_mean


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int | None = None,
    var_update_scaler: int = 16,
    local_step_scaler: int | None = None,
    local_step_clipper: int | None = None,
    *,
    axis_name: AxisName,
    total_steps: int | None = None,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    bias_correction: bool | None = None,
    variance_floor: float | None = 0.1,
    deepspeed_compat: bool = False,
    max_consecutive_skips: int | None = 16,
    precondition: bool | None = None,
    interval_weighted_variance: bool | None = None,
    compress_momentum: bool | None = None,
) -> optax.GradientTransformation:
    """DeepSpeed's 0/1 Adam (``ZeroOneAdam``) over local gradients.

    **Parameters are per device**: after the variance freeze, devices take local steps and only
    synchronise every ``local_interval`` steps, so their parameters differ in between (and, by
    rounding, slightly even after). Keep one copy per device: :mod:`jaxcomm.train.layout` stacks
    the parameters on the axis for this optimizer (it detects a :class:`ZeroOneAdamState`).

    The rules of each step are :func:`scale_by_zero_one_adam`'s (see there); the returned optax
    update is its parameter change in each parameter's dtype. The learning rate (and the weight
    decay) stay inside: the local steps' ``lr * update`` are summed in ``u`` and a
    synchronisation divides by the summed rates, so no ``scale_by_learning_rate`` follows.

    No bias correction (DeepSpeed reads the flag and ignores it). DeepSpeed's first ``step()``
    only allocates buffers, so its interval checks see ``t + 1``; here ``t`` counts real updates
    from 1. Everything else, including the shared error buffers for both 1-bit all-reduces, is
    DeepSpeed's rule. The returned optax update is the parameter change of the step.

    Run length. DeepSpeed's constants (``var_freeze_step=100000``, ``local_step_scaler=32678``)
    are for 100k+-step runs; in a short run they never freeze. Pass ``total_steps`` and the
    unset ones follow it (:func:`schedule_for`): ``var_freeze_step = round(0.15 total_steps)``,
    ``local_step_scaler = round(var_freeze_step / 3)`` (DeepSpeed's ratio).

    Safe defaults (``deepspeed_compat=True`` restores DeepSpeed's rules exactly, including
    ``local_step_clipper=16``; both rule sets are tested against NumPy models), chosen on the
    byte-level transformer LM of ``benchmarks/convergence.py``
    (``--devices 2,8 --warmup 0.05,0.15``, runs of 384 to 768 steps; the script prints the
    comparison):

    * ``local_step_clipper = 2`` (DeepSpeed: 16), the largest interval between
      synchronisations. Local steps cost loss in proportion to their interval and buy little
      traffic: the exact variance updates dominate the bytes (about ``16 log2(F / 16 + 1)``
      exact steps for a freeze at step ``F``). For runs far longer than ``F`` a larger cap
      saves more; measure it.
    * ``compress_momentum``: the variance stage's 1-bit steps average the local momenta
      ``b1 m + (1-b1) g_r`` instead of the gradients (1-bit Adam's choice: the momentum's 1-bit
      error relative to its size is far smaller than the gradient's).
    * ``interval_weighted_variance``: a variance update stands for the ``var_interval`` steps
      since the last one, ``v = b2^k v + (1 - b2^k) g^2`` with ``k = var_interval`` (DeepSpeed
      weighs every update as one step, so the 16 updates of the first 16 steps, whose gradients
      are the largest, weigh as much as the 16 of steps 64-128). ``var_updates`` then counts
      the steps covered and ``v``'s bias correction is ``1 - b2^var_updates``.
    * ``bias_correction`` of ``m`` by ``t`` and of ``v`` by ``var_updates`` (without it the
      variance is ``1 - b2^var_updates`` of its value, and the steps several times Adam's); a
      synchronisation sets ``m = -c1 u / lrs`` (the mean step in momentum space is of ``m /
      c1``).
    * the ``variance_floor`` of :func:`jaxcomm.onebit_adam` on every denominator (1-bit
      momentum steps and synchronisations otherwise divide a 1-bit scale by ``~eps``).
    * ``precondition``: the variance stage's 1-bit means carry ``x / denom`` and a
      synchronisation averages ``u`` itself, in the space of Adam's steps, whose magnitudes are
      even across coordinates (one 1-bit scale fits them); both are mapped back by ``denom``
      (frozen or replicated: exact without compression).

    ``axis_name`` may be a tuple of mesh axes, slowest first (``("host", "local")``): every
    mean is then exact inside the fast axes and 1-bit only across the first
    (:mod:`jaxcomm.comm.two_level`), and the local steps run on every device as on one axis.

    A non-finite step on any device is skipped on all of them (one int32 ``pmin`` per step, so
    that local steps stay in step), counted in ``state.skips``, and more than
    ``max_consecutive_skips`` in a row raise.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> tx = jc.zero_one_adam(1e-3, axis_name="dp", total_steps=100, axis_size=2)
      >>> params = {"w": jnp.ones(4)}
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")
      >>> updates, state = step({"w": jnp.ones((2, 4))}, state)  # a variance update: exact
      >>> [round(float(u), 6) for u in updates["w"][0]]
      [-0.001, -0.001, -0.001, -0.001]

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`ZeroOneAdamState`. ``update``
      needs ``params`` when ``weight_decay`` is non-zero.
    """
    tx = scale_by_zero_one_adam(
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        var_freeze_step,
        var_update_scaler,
        local_step_scaler,
        local_step_clipper,
        axis_name=axis_name,
        total_steps=total_steps,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        axis_size=axis_size,
        bias_correction=bias_correction,
        variance_floor=variance_floor,
        deepspeed_compat=deepspeed_compat,
        max_consecutive_skips=max_consecutive_skips,
        precondition=precondition,
        interval_weighted_variance=interval_weighted_variance,
        compress_momentum=compress_momentum,
    )

    def update_fn(updates, state, params=None):
        delta, new_state = tx.update(updates, state, params)
        return cast_like(delta, updates if params is None else params), new_state

    return optax.GradientTransformation(tx.init, update_fn)
