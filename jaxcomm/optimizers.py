"""Optax transformations that communicate through jaxcomm's compressed collectives.

Each transformation's ``update`` runs where the data-parallel axis is bound (inside
``jax.shard_map`` or ``jax.pmap``, e.g. via :mod:`jaxcomm.parallel`) and takes **this device's
local gradients**: the transformation does the cross-device communication itself.

* :func:`compressed_mean`: the (compressed) mean of the gradients, with error feedback. Chain it
  before any optax optimizer: ``optax.chain(jc.compressed_mean("dp"), optax.adam(1e-3))``.
* :func:`onebit_adam`: DeepSpeed's 1-bit Adam (exact warm-up, then 1-bit momentum all-reduce).
* :func:`zero_one_adam`: DeepSpeed's 0/1 Adam (adaptive variance freezing and local steps).
* :func:`onebit_lamb`: DeepSpeed's 1-bit LAMB (exact LAMB warm-up, then 1-bit momentum with
  frozen, corrected trust ratios).

State layout. Leaves of a state are either **replicated** (identical on every device: step
counts, Adam moments computed from reduced values, hyperparameters) or **per-device** (the
error feedback of the 1-bit collectives, 0/1 Adam's local momentum). Per-device leaves live only
inside the NamedTuple types listed in :data:`jaxcomm.parallel.PER_DEVICE_TYPES`
(``jc.ReduceState``, ``jc.ScatterState``, :class:`LocalState`), so
:func:`jaxcomm.parallel.state_partition_specs` can tell them apart by walking the tree.

``init`` needs the size of the axis to lay out the error feedback. It is taken from the
``axis_size`` argument; if that is ``None``, from ``lax.axis_size(axis_name)`` when ``init`` is
called where the axis is bound (in ``shard_map``/``pmap``, or under ``jax.vmap(...,
axis_name=...)`` as :mod:`jaxcomm.parallel` does), else from ``jax.device_count()``.

Dtypes. Moments and error feedback are fp32 whatever the parameter dtype; updates are returned
in each parameter's dtype (bf16 parameters get bf16 updates). Learning rates accept optax
schedules (evaluated at the step count, starting at 0) and ``optax.inject_hyperparams`` works;
pass ``static_args=("bucket_bytes", "axis_size")`` to it when you set those to integers, and
``hyperparam_dtype=jnp.float32`` with bf16 parameters (optax otherwise stores the
hyperparameters in the parameters' dtype, where ``b2 = 0.999`` rounds to 1.0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.collectives import ReduceState, compressed_pmean, init_state
from jaxcomm.compressors import Compressor, NoCompression, OneBit

PyTree = Any
ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


class LocalState(NamedTuple):
    """0/1 Adam's per-device leaves (they differ between devices between synchronisations).

    Attributes:
      mu: first moment, fp32, shaped like the parameters.
      u: accumulated local updates since the last synchronisation (DeepSpeed's
        ``momentum_accumulator``), fp32, shaped like the parameters.
    """

    mu: PyTree
    u: PyTree


class CompressedMeanState(NamedTuple):
    """State of :func:`compressed_mean`.

    Attributes:
      count: updates done so far (int32 scalar, replicated).
      comm: error feedback of the compressed all-reduce (per-device ``jc.ReduceState``).
    """

    count: jax.Array
    comm: ReduceState


class OneBitAdamState(NamedTuple):
    """State of :func:`onebit_adam`.

    Attributes:
      count: updates done so far (int32 scalar, replicated).
      mu: first moment, fp32, replicated (the compressed all-reduce output is identical on every
        device).
      nu: second moment, fp32, replicated (frozen after ``freeze_step``).
      comm: error feedback of the 1-bit momentum all-reduce (per-device ``jc.ReduceState``).
    """

    count: jax.Array
    mu: PyTree
    nu: PyTree
    comm: ReduceState


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam`. Scalars are replicated int32/fp32.

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


# --------------------------------------------------------------------------------------------
# Shared helpers


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


def _static_bucket_bytes(bucket_bytes) -> int | None:
    if bucket_bytes is None or isinstance(bucket_bytes, int):
        return bucket_bytes
    try:
        return int(np.asarray(bucket_bytes))
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(
            "jaxcomm: bucket_bytes must be a static int. Under optax.inject_hyperparams pass "
            "static_args=('bucket_bytes', 'axis_size')."
        ) from err


def _check_compressor(compressor) -> None:
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"jaxcomm: compressor must be a jaxcomm Compressor (e.g. jc.OneBit()), got "
            f"{compressor!r}"
        )


def _f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _zeros_f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def _learning_rate(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.asarray(lr, jnp.float32)


def _is_static_zero(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _static_int(value) -> int | None:
    """``value`` as a Python int when it is known at trace time, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    return None


def _needs_params(params, weight_decay, name: str) -> None:
    if params is None and not _is_static_zero(weight_decay):
        raise ValueError(
            f"jaxcomm: {name} with weight_decay needs params: call update(grads, state, params)"
        )


def _cast_like(updates: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda u, x: u.astype(jnp.asarray(x).dtype), updates, like)


def _exact_mean(tree: PyTree, axis_name: str, bucket_bytes: int | None) -> PyTree:
    """Exact mean, fused into one collective per bucket (``NoCompression`` is stateless)."""
    out, _ = compressed_pmean(
        tree, None, axis_name=axis_name, compressor=NoCompression(), bucket_bytes=bucket_bytes
    )
    return out


def _compressed_mean_call(tree, comm, axis_name, compressor, bucket_bytes):
    """``compressed_pmean`` that keeps a leafless state (exact compressors) as it was."""
    if not jax.tree_util.tree_leaves(comm):
        out, _ = compressed_pmean(
            tree, None, axis_name=axis_name, compressor=compressor, bucket_bytes=bucket_bytes
        )
        return out, comm
    return compressed_pmean(
        tree, comm, axis_name=axis_name, compressor=compressor, bucket_bytes=bucket_bytes
    )


def _varying(tree: PyTree, axis_name: str) -> PyTree:
    return jax.tree.map(lambda x: ensure_varying(x, axis_name), tree)


# --------------------------------------------------------------------------------------------
# compressed_mean


def compressed_mean(
    axis_name: str,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    warmup_steps: int = 0,
    *,
    axis_size: int | None = None,
) -> optax.GradientTransformation:
    """Mean of the local gradients over ``axis_name``, compressed, with error feedback.

    ``update(grads, state)`` takes this device's gradients and returns their mean over the axis
    (identical on every device, typed replicated under ``check_vma``), each leaf in its own
    dtype. For the first ``warmup_steps`` updates the mean is exact (one fused collective per
    bucket); afterwards it goes through ``compressor`` with error feedback. Both paths are in
    the compiled program and ``lax.cond`` picks one at run time (with ``warmup_steps=0`` only the
    compressed path is compiled).

    Args:
      axis_name: the data-parallel mesh or pmap axis.
      compressor: default ``jc.OneBit()``.
      bucket_bytes: bucket size of the collectives (``None``: one bucket per dtype).
      warmup_steps: number of initial updates reduced exactly.
      axis_size: devices on the axis, for ``init`` (see the module docstring for the default).

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`CompressedMeanState`.
    """
    compressor = OneBit() if compressor is None else compressor
    _check_compressor(compressor)
    bucket_bytes = _static_bucket_bytes(bucket_bytes)
    static_warmup = _static_int(warmup_steps)

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        comm = init_state(compressor, params, axis_size=n, bucket_bytes=bucket_bytes)
        return CompressedMeanState(count=jnp.zeros([], jnp.int32), comm=comm)

    def update_fn(updates, state, params=None):
        del params

        def exact(grads, comm):
            return _exact_mean(grads, axis_name, bucket_bytes), comm

        def compressed(grads, comm):
            return _compressed_mean_call(grads, comm, axis_name, compressor, bucket_bytes)

        if static_warmup is not None and static_warmup <= 0:
            mean, comm = compressed(updates, state.comm)
        else:
            mean, comm = lax.cond(
                state.count < warmup_steps, exact, compressed, updates, state.comm
            )
        return mean, CompressedMeanState(count=state.count + 1, comm=comm)

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# 1-bit Adam


def onebit_adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int = 100000,
    *,
    axis_name: str,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    bias_correction: bool = False,
) -> optax.GradientTransformation:
    """DeepSpeed's 1-bit Adam (``OnebitAdam``) as an optax transformation over local gradients.

    With ``t = count + 1`` the 1-based step, ``g_r`` this device's gradient and ``p`` the
    parameters:

    * warm-up, the first ``freeze_step`` updates (``count < freeze_step``): ``g = mean_r g_r``
      exactly; ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    * compression, from update ``freeze_step`` on: ``m = b1 m + (1-b1) g_r`` locally, then
      ``m = OneBit-mean_r(m)`` (worker and server error feedback); ``v`` stays frozen;
    * both: ``update = m / (sqrt(v) + eps) + weight_decay * p``; the returned optax update is
      ``-lr(count) * update`` (apply it with ``optax.apply_updates``).

    Like DeepSpeed there is **no bias correction** by default (DeepSpeed reads the flag and
    ignores it). ``bias_correction=True`` uses ``m / (1 - b1^t)`` and ``v / (1 - b2^tv)`` with
    ``tv = min(t, freeze_step)``, the step at which ``v`` was last updated.

    Differences from DeepSpeed, on purpose: DeepSpeed's first ``step()`` only allocates buffers
    (so it runs ``freeze_step - 1`` real warm-up updates); here every call is an update and
    there are exactly ``freeze_step`` warm-up updates. The error feedback is part of the state,
    so it survives checkpoints (DeepSpeed drops it on load). DeepSpeed compresses each parameter
    tensor separately: ``bucket_bytes=1`` does the same (one bucket per leaf); the default
    ``None`` compresses all parameters as one bucket (one collective chain, one scale).

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps, weight_decay: as DeepSpeed's ``OnebitAdam`` (``weight_decay`` is L2 added to
        the update, so ``update`` needs ``params`` when it is non-zero).
      freeze_step: number of exact warm-up updates (may be a traced int).
      axis_name: the data-parallel axis.
      compressor: default ``jc.OneBit()``; ``jc.NoCompression()`` makes it exact Adam with v
        frozen after ``freeze_step``.
      bucket_bytes: bucket size of the momentum all-reduce (and the warm-up gradient mean).
      axis_size: devices on the axis, for ``init``.
      bias_correction: see above (default False, as DeepSpeed).

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`OneBitAdamState`; ``mu`` and
      ``nu`` are replicated, ``comm`` per device. Parameters stay replicated.
    """
    compressor = OneBit() if compressor is None else compressor
    _check_compressor(compressor)
    bucket_bytes = _static_bucket_bytes(bucket_bytes)
    static_freeze = _static_int(freeze_step)

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        mu = _zeros_f32(params)
        comm = init_state(compressor, mu, axis_size=n, bucket_bytes=bucket_bytes)
        return OneBitAdamState(jnp.zeros([], jnp.int32), mu, _zeros_f32(params), comm)

    def update_fn(updates, state, params=None):
        _needs_params(params, weight_decay, "onebit_adam")
        grads = _f32(updates)
        b1_, b2_ = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)

        def warm(g, mu, nu, comm):
            g = _exact_mean(g, axis_name, bucket_bytes)
            mu = jax.tree.map(lambda m, x: b1_ * m + (1 - b1_) * x, mu, g)
            nu = jax.tree.map(lambda v, x: b2_ * v + (1 - b2_) * jnp.square(x), nu, g)
            return mu, nu, comm

        def compress(g, mu, nu, comm):
            local = jax.tree.map(lambda m, x: b1_ * m + (1 - b1_) * x, mu, g)
            mu, comm = _compressed_mean_call(local, comm, axis_name, compressor, bucket_bytes)
            return mu, nu, comm

        args = (grads, state.mu, state.nu, state.comm)
        if static_freeze is not None and static_freeze <= 0:
            mu, nu, comm = compress(*args)
        else:
            mu, nu, comm = lax.cond(state.count < freeze_step, warm, compress, *args)

        t = state.count + 1
        m_hat, v_hat = mu, nu
        if bias_correction:
            tv = jnp.maximum(jnp.minimum(t, freeze_step), 1).astype(jnp.float32)
            c1 = 1 - b1_ ** t.astype(jnp.float32)
            c2 = 1 - b2_**tv
            m_hat = jax.tree.map(lambda m: m / c1, mu)
            v_hat = jax.tree.map(lambda v: v / c2, nu)
        lr = _learning_rate(learning_rate, state.count)
        wd = jnp.asarray(weight_decay, jnp.float32)

        def step(m, v, p):
            update = m / (jnp.sqrt(v) + jnp.asarray(eps, jnp.float32))
            if p is not None:
                update = update + wd * jnp.asarray(p, jnp.float32)
            return -lr * update

        if params is None:
            new_updates = jax.tree.map(lambda m, v: step(m, v, None), m_hat, v_hat)
            new_updates = _cast_like(new_updates, updates)
        else:
            new_updates = jax.tree.map(step, m_hat, v_hat, params)
            new_updates = _cast_like(new_updates, params)
        return new_updates, OneBitAdamState(t, mu, nu, comm)

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# 0/1 Adam


def zero_one_adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int = 100000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    *,
    axis_name: str,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
) -> optax.GradientTransformation:
    """DeepSpeed's 0/1 Adam (``ZeroOneAdam``) over local gradients.

    **Parameters are per device**: after the variance freeze, devices take local steps and only
    synchronise every ``local_interval`` steps, so their parameters differ in between (and, by
    rounding, slightly even after). Keep one copy per device: :mod:`jaxcomm.parallel` stacks
    the parameters on the axis for this optimizer (it detects a :class:`ZeroOneAdamState`).

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

    No bias correction (DeepSpeed reads the flag and ignores it). DeepSpeed's first ``step()``
    only allocates buffers, so its interval checks see ``t + 1``; here ``t`` counts real updates
    from 1. Everything else, including the shared error buffers for both 1-bit all-reduces, is
    DeepSpeed's rule. The returned optax update is the parameter change of the step.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`ZeroOneAdamState`. ``update``
      needs ``params`` when ``weight_decay`` is non-zero.
    """
    compressor = OneBit() if compressor is None else compressor
    _check_compressor(compressor)
    bucket_bytes = _static_bucket_bytes(bucket_bytes)

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        zeros = _zeros_f32(params)
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
            nu=_zeros_f32(params),
            local=LocalState(mu=zeros, u=_zeros_f32(params)),
            comm=comm,
        )

    def update_fn(updates, state, params=None):
        _needs_params(params, weight_decay, "zero_one_adam")
        grads = _f32(updates)
        f32 = jnp.float32
        b1_, b2_ = jnp.asarray(b1, f32), jnp.asarray(b2, f32)
        eps_, wd = jnp.asarray(eps, f32), jnp.asarray(weight_decay, f32)
        lr = _learning_rate(learning_rate, state.count)
        p32 = None if params is None else _f32(params)
        t = state.count + 1
        frozen = t > var_freeze_step

        def adam_step(mu, nu):
            """``lr * update`` (before the sign), per leaf."""

            def one(m, v, p):
                update = m / (jnp.sqrt(v) + eps_)
                if p is not None:
                    update = update + wd * p
                return lr * update

            if p32 is None:
                return jax.tree.map(lambda m, v: one(m, v, None), mu, nu)
            return jax.tree.map(one, mu, nu, p32)

        def ema(m, x, beta):
            return jax.tree.map(lambda a, b: beta * a + (1 - beta) * b, m, x)

        def neg(tree):
            return jax.tree.map(lambda x: -x, tree)

        def finish(mu, nu, u, lrs, comm, delta):
            # All branches agree on types: per-device leaves varying, the rest replicated.
            return (
                _varying(mu, axis_name),
                nu,
                _varying(u, axis_name),
                jnp.asarray(lrs, f32),
                comm,
                _varying(delta, axis_name),
            )

        def var_update(g, mu, nu, u, lrs, comm):
            g = _exact_mean(g, axis_name, bucket_bytes)
            mu, nu = ema(mu, g, b1_), ema(nu, jax.tree.map(jnp.square, g), b2_)
            return finish(mu, nu, u, lrs, comm, neg(adam_step(mu, nu)))

        def onebit_momentum(g, mu, nu, u, lrs, comm):
            g, comm = _compressed_mean_call(g, comm, axis_name, compressor, bucket_bytes)
            mu = ema(mu, g, b1_)
            return finish(mu, nu, u, lrs, comm, neg(adam_step(mu, nu)))

        def local_step(g, mu, nu, u, lrs, comm):
            mu = ema(mu, g, b1_)
            step = adam_step(mu, nu)
            u = jax.tree.map(lambda a, s: a - s, u, step)
            return finish(mu, nu, u, lrs + lr, comm, neg(step))

        def local_step_sync(g, mu, nu, u, lrs, comm):
            mu = ema(mu, g, b1_)
            lrs = lrs + lr
            step = adam_step(mu, nu)
            u = jax.tree.map(lambda a, s: a - s, u, step)
            # Zero the error feedback at the variance freeze (the first frozen step is always a
            # synchronisation: local_interval is still 1 then).
            first = t == var_freeze_step + 1
            comm = jax.tree.map(lambda e: jnp.where(first, jnp.zeros_like(e), e), comm)
            denom = jax.tree.map(lambda v: jnp.sqrt(v) + eps_, nu)
            scaled = jax.tree.map(lambda a, d: a * d, u, denom)
            avg, comm = _compressed_mean_call(scaled, comm, axis_name, compressor, bucket_bytes)
            mu = jax.tree.map(lambda a: -a / lrs, avg)
            # p + delta = (p - lr*update) - u + avg / denom, DeepSpeed's order of the three terms.
            delta = jax.tree.map(lambda s, a, c, d: (-s - a) + c / d, step, u, avg, denom)
            return finish(mu, nu, jax.tree.map(jnp.zeros_like, u), 0.0, comm, delta)

        var_step = (t % state.var_interval) == 0
        sync = (t % state.local_interval) == 0
        branch = jnp.where(frozen, jnp.where(sync, 3, 2), jnp.where(var_step, 0, 1)).astype(
            jnp.int32
        )
        mu, nu, u, lrs, comm, delta = lax.switch(
            branch,
            (var_update, onebit_momentum, local_step, local_step_sync),
            grads,
            _varying(state.local.mu, axis_name),
            state.nu,
            _varying(state.local.u, axis_name),
            state.lrs,
            state.comm,
        )

        # Interval policies (DeepSpeed's order: after the step's update).
        var_counted = jnp.logical_and(~frozen, var_step)
        var_counter = jnp.where(var_counted, state.var_counter + 1, state.var_counter)
        var_doubles = var_counter == var_update_scaler
        var_counter = jnp.where(var_doubles, 0, var_counter).astype(jnp.int32)
        var_interval = jnp.where(var_doubles, state.var_interval * 2, state.var_interval)
        local_counter = jnp.where(frozen, state.local_counter + 1, state.local_counter)
        local_doubles = local_counter == local_step_scaler
        local_counter = jnp.where(local_doubles, 0, local_counter).astype(jnp.int32)
        local_interval = jnp.where(
            local_doubles,
            jnp.minimum(local_step_clipper, state.local_interval * 2),
            state.local_interval,
        )

        like = updates if params is None else params
        new_state = ZeroOneAdamState(
            count=t,
            var_interval=var_interval.astype(jnp.int32),
            var_counter=var_counter,
            local_interval=local_interval.astype(jnp.int32),
            local_counter=local_counter,
            lrs=lrs,
            nu=nu,
            local=LocalState(mu=mu, u=u),
            comm=comm,
        )
        return _cast_like(delta, like), new_state

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# 1-bit LAMB


class OneBitLambState(NamedTuple):
    """State of :func:`onebit_lamb`. Everything but ``comm`` is replicated.

    Attributes:
      count: updates done so far (int32 scalar).
      mu: first moment, fp32 (after the switch: the 1-bit mean with the scaling removed).
      nu: second moment, fp32, frozen after ``freeze_step``.
      nu_fresh: DeepSpeed's ``exp_avg_sq_fresh``, fp32: a copy of ``nu`` at update
        ``freeze_step``, then updated from the gradient reconstructed from the momenta.
      coeff_freeze: per leaf, an fp32 scalar: the EMA of the warm-up trust ratios
        (DeepSpeed's ``lamb_coeff_freeze``, starts at 0), frozen after ``freeze_step``.
      last_factor: per leaf, an fp32 scalar: the previous correction factor (starts at 1).
      scaling_coeff: per leaf, an fp32 scalar: the momentum scaling coefficient, 1 until the
        first compression update computes it.
      comm: error feedback of the 1-bit momentum all-reduce (per-device ``jc.ReduceState``).
    """

    count: jax.Array
    mu: PyTree
    nu: PyTree
    nu_fresh: PyTree
    coeff_freeze: PyTree
    last_factor: PyTree
    scaling_coeff: PyTree
    comm: ReduceState


def _check_static_range(
    name: str, value, low=None, high=None, *, low_open=False, high_open=False
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
        raise ValueError(f"jaxcomm: onebit_lamb {name} must be in {interval}, got {value!r}")


def _norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x)))


def onebit_lamb(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int = 100000,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    *,
    axis_name: str,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
) -> optax.GradientTransformation:
    """DeepSpeed's 1-bit LAMB (``OnebitLamb``) as an optax transformation over local gradients.

    Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
    LAMB's Convergence Speed" (arXiv:2104.06069). Every leaf of the parameter tree is one of
    DeepSpeed's parameter tensors: trust ratios and coefficients are per leaf. With
    ``t = count + 1`` the 1-based update, ``g_r`` this device's gradient, ``p`` a leaf of the
    parameters and norms taken over the leaf (DeepSpeed defaults in brackets):

    * warm-up, ``t <= freeze_step`` (100000): LAMB on the exact mean gradient ``g = mean_r g_r``:
      ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``; ``u = m / (sqrt(v) + eps) + wd p``;
      the trust ratio ``c = clip(||p|| / ||u||, min_coeff (0.01), max_coeff (10))``, or
      ``c = 1`` when either norm is 0; if ``c != 1``, ``coeff_freeze = coeff_beta (0.9)
      coeff_freeze + (1 - coeff_beta) c`` (DeepSpeed's rule, including the skip at exactly 1);
      ``p -= lr c u``. At ``t = freeze_step``, ``v_fresh = v``.
    * the switch, ``t = freeze_step + 1``, before anything else: per leaf ``s_p = ||m_p|| /
      sqrt(numel_p)`` and ``scaling_coeff_p = mean_q(s_q) / s_p``, kept for the rest of the run.
    * compression, ``t > freeze_step``: ``m_prev = m``; ``m_r = (b1 m + (1-b1) g_r) *
      scaling_coeff`` locally; ``m = OneBit-mean_r(m_r) / scaling_coeff`` (worker and server
      error feedback; ``v`` stays frozen); ``g~ = (m - b1 m_prev) / (1 - b1)`` and ``v_fresh =
      b2 v_fresh + (1-b2) g~^2``; ``u = m / (sqrt(v) + eps) + wd p``; the correction factor
      ``f = max(elementwise (sqrt(v) + eps) / (sqrt(v_fresh) + eps))``, with weight decay
      ``r = min(1, ||m / (sqrt(v) + eps)|| / ||u||)`` and ``f = f r + (1 - r)``; then ``f`` is
      clipped to ``[factor_min (0.5), factor_max (4)]`` and to ``[(1 - factor_threshold (0.1))
      f_prev, (1 + factor_threshold) f_prev]`` (``f_prev`` starts at 1); ``p -= lr
      coeff_freeze f u``.

    The returned optax update is ``-lr(count) * c * u`` with ``c = coeff_freeze f`` after the
    switch (apply it with ``optax.apply_updates``), in each parameter's dtype.

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

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps, weight_decay: as DeepSpeed's ``OnebitLamb`` (``weight_decay`` is L2 added to
        the update).
      freeze_step: number of exact warm-up updates, at least 1 (the frozen trust ratio comes
        from the warm-up; may be a traced int).
      max_coeff, min_coeff: clip of the warm-up trust ratio.
      coeff_beta: EMA coefficient of the trust ratio (``1 / (1 - coeff_beta)`` should not
        exceed ``freeze_step``, DeepSpeed advises).
      factor_max, factor_min, factor_threshold: clips of the correction factor.
      axis_name: the data-parallel axis.
      compressor: default ``jc.OneBit()``.
      bucket_bytes: bucket size of the momentum all-reduce (and the warm-up gradient mean);
        ``None``: one bucket.
      axis_size: devices on the axis, for ``init``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`OneBitLambState`; ``comm`` is
      per device, the rest replicated. Parameters stay replicated.
    """
    compressor = OneBit() if compressor is None else compressor
    _check_compressor(compressor)
    bucket_bytes = _static_bucket_bytes(bucket_bytes)
    static_freeze = _static_int(freeze_step)
    if static_freeze is not None and static_freeze < 1:
        raise ValueError(
            f"jaxcomm: onebit_lamb needs freeze_step >= 1 (the frozen LAMB coefficient is an "
            f"average over the warm-up), got {freeze_step!r}"
        )
    _check_static_range("b1", b1, 0.0, 1.0, high_open=True)  # g~ divides by 1 - b1
    _check_static_range("b2", b2, 0.0, 1.0)
    _check_static_range("coeff_beta", coeff_beta, 0.0, 1.0)
    _check_static_range("min_coeff", min_coeff, 0.0, low_open=True)
    _check_static_range("max_coeff", max_coeff, 0.0, low_open=True)
    _check_static_range("factor_min", factor_min, 0.0, low_open=True)
    _check_static_range("factor_max", factor_max, 0.0, low_open=True)
    _check_static_range("factor_threshold", factor_threshold, 0.0)
    for low, high, names in (
        (min_coeff, max_coeff, "min_coeff <= max_coeff"),
        (factor_min, factor_max, "factor_min <= factor_max"),
    ):
        if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
            raise ValueError(f"jaxcomm: onebit_lamb needs {names}, got {low!r} > {high!r}")

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        mu = _zeros_f32(params)
        comm = init_state(compressor, mu, axis_size=n, bucket_bytes=bucket_bytes)

        def scalars(value):
            return jax.tree.map(lambda _: jnp.full([], value, jnp.float32), params)

        return OneBitLambState(
            count=jnp.zeros([], jnp.int32),
            mu=mu,
            nu=_zeros_f32(params),
            nu_fresh=_zeros_f32(params),
            coeff_freeze=scalars(0.0),
            last_factor=scalars(1.0),
            scaling_coeff=scalars(1.0),
            comm=comm,
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "jaxcomm: onebit_lamb needs params for the trust ratio: call "
                "update(grads, state, params)"
            )
        f32 = jnp.float32
        grads = _f32(updates)
        p32 = _f32(params)
        b1_, b2_, eps_ = (jnp.asarray(x, f32) for x in (b1, b2, eps))
        wd = jnp.asarray(weight_decay, f32)
        lr = _learning_rate(learning_rate, state.count)
        t = state.count + 1

        def lamb_update(m, v, p):
            """(m / (sqrt(v) + eps), the same plus weight decay, sqrt(v) + eps) of one leaf."""
            denom = jnp.sqrt(v) + eps_
            prelim = m / denom
            return prelim, prelim + wd * p, denom

        def warm(g, mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm):
            g = _exact_mean(g, axis_name, bucket_bytes)
            mu = jax.tree.map(lambda m, x: b1_ * m + (1 - b1_) * x, mu, g)
            nu = jax.tree.map(lambda v, x: b2_ * v + (1 - b2_) * jnp.square(x), nu, g)
            nu_fresh = jax.tree.map(lambda v, vf: jnp.where(t == freeze_step, v, vf), nu, nu_fresh)

            def leaf(m, v, p, cf):
                _, update, _ = lamb_update(m, v, p)
                w_norm, u_norm = _norm(p), _norm(update)
                ratio = jnp.clip(w_norm / jnp.where(u_norm > 0, u_norm, 1), min_coeff, max_coeff)
                coeff = jnp.where((w_norm > 0) & (u_norm > 0), ratio, 1.0).astype(f32)
                ema = coeff_beta * cf + (1 - coeff_beta) * coeff
                cf = jnp.where(coeff != 1.0, ema, cf).astype(f32)
                return -lr * coeff * update, cf

            out = jax.tree.map(leaf, mu, nu, p32, coeff_freeze)
            delta, coeff_freeze = _unzip(out, mu)
            return mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, delta

        def compress(g, mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm):
            scaling = jax.tree.map(
                lambda new, old: jnp.where(t == freeze_step + 1, new, old),
                _scaling_coefficients(mu),
                scaling,
            )
            local = jax.tree.map(lambda m, x, s: (b1_ * m + (1 - b1_) * x) * s, mu, g, scaling)
            avg, comm = _compressed_mean_call(local, comm, axis_name, compressor, bucket_bytes)
            m_prev = mu
            mu = jax.tree.map(lambda a, s: a / s, avg, scaling)

            def leaf(m, m_last, v, vf, p, cf, last):
                g_rec = (m - b1_ * m_last) / (1 - b1_)
                vf = b2_ * vf + (1 - b2_) * jnp.square(g_rec)
                prelim, update, denom = lamb_update(m, v, p)
                u_norm = _norm(update)
                factor = jnp.max(denom / (jnp.sqrt(vf) + eps_), initial=0.0)
                ratio = jnp.where(
                    u_norm > 0,
                    jnp.minimum(1.0, _norm(prelim) / jnp.where(u_norm > 0, u_norm, 1)),
                    1.0,
                )
                factor = jnp.where(wd > 0, factor * ratio + (1 - ratio), factor)
                factor = jnp.maximum(jnp.minimum(factor, factor_max), factor_min)
                factor = jnp.minimum(factor, last * (1 + factor_threshold))
                factor = jnp.maximum(factor, last * (1 - factor_threshold)).astype(f32)
                return (vf, factor, -lr * (cf * factor) * update)

            out = jax.tree.map(leaf, mu, m_prev, nu, nu_fresh, p32, coeff_freeze, last_factor)
            nu_fresh, last_factor, delta = _unzip(out, mu, 3)
            return mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, delta

        args = (
            grads,
            state.mu,
            state.nu,
            state.nu_fresh,
            state.coeff_freeze,
            state.last_factor,
            state.scaling_coeff,
            state.comm,
        )
        mu, nu, nu_fresh, coeff_freeze, last_factor, scaling, comm, delta = lax.cond(
            state.count < freeze_step, warm, compress, *args
        )
        new_state = OneBitLambState(
            count=t,
            mu=mu,
            nu=nu,
            nu_fresh=nu_fresh,
            coeff_freeze=coeff_freeze,
            last_factor=last_factor,
            scaling_coeff=scaling,
            comm=comm,
        )
        return _cast_like(delta, params), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _unzip(out: PyTree, like: PyTree, k: int = 2) -> tuple:
    """A tree of ``k``-tuples (structured like ``like``) -> ``k`` trees."""
    treedef = jax.tree.structure(like)
    rows = treedef.flatten_up_to(out)
    return tuple(treedef.unflatten([row[i] for row in rows]) for i in range(k))


def _scaling_coefficients(mu: PyTree) -> PyTree:
    """1-bit LAMB's ``mean_q(s_q) / s_p`` with ``s_p = ||m_p|| / sqrt(numel_p)``, per leaf.

    Empty leaves are left out of the mean; a leaf with ``s_p = 0`` (or an empty one) gets 1.
    """
    leaves, treedef = jax.tree.flatten(mu)
    scales = [_norm(m) / np.sqrt(m.size) if m.size else jnp.zeros([], jnp.float32) for m in leaves]
    counted = [s for s, m in zip(scales, leaves, strict=True) if m.size]
    united = sum(counted) / len(counted) if counted else jnp.zeros([], jnp.float32)
    coeffs = [
        jnp.where(s > 0, united / jnp.where(s > 0, s, 1), 1.0).astype(jnp.float32) for s in scales
    ]
    return treedef.unflatten(coeffs)


__all__ = [
    "CompressedMeanState",
    "LocalState",
    "OneBitAdamState",
    "OneBitLambState",
    "ZeroOneAdamState",
    "compressed_mean",
    "onebit_adam",
    "onebit_lamb",
    "resolve_axis_size",
    "zero_one_adam",
]
