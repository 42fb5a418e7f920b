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
:mod:`jaxcomm.parallel` read it), and the learning rate is evaluated at the same ``count`` as the
moments (a chained ``scale_by_learning_rate`` keeps its own count). The result is bit for bit
the chain ``optax.chain(scale_by_onebit_adam(...), optax.add_decayed_weights(wd),
optax.scale_by_learning_rate(lr))`` for fp32 parameters (weight decay is taken on fp32 copies of
the parameters, so bf16 parameters lose no precision in ``wd * p``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm.collectives import ReduceState, init_state
from jaxcomm.compressors import Compressor, OneBit
from jaxcomm.optim._common import (
    PyTree,
    cast_like,
    check_compressor,
    compressed_mean_call,
    ema,
    exact_mean,
    f32,
    learning_rate_at,
    needs_params,
    resolve_axis_size,
    static_bucket_bytes,
    static_int,
    zeros_f32,
)


class OneBitAdamState(NamedTuple):
    """State of :func:`scale_by_onebit_adam` and :func:`onebit_adam`.

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


def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    freeze_step: int = 100000,
    *,
    axis_name: str,
    compressor: Compressor | None = None,
    bucket_bytes: int | None = None,
    axis_size: int | None = None,
    bias_correction: bool = False,
) -> optax.GradientTransformation:
    """1-bit Adam's direction ``m / (sqrt(v) + eps)`` from this device's local gradients.

    With ``t = count + 1`` the 1-based step and ``g_r`` this device's gradient:

    * warm-up, the first ``freeze_step`` updates (``count < freeze_step``): ``g = mean_r g_r``
      exactly; ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    * compression, from update ``freeze_step`` on: ``m = b1 m + (1-b1) g_r`` locally, then
      ``m = OneBit-mean_r(m)`` (worker and server error feedback); ``v`` stays frozen;
    * both: the returned direction is ``m / (sqrt(v) + eps)``, fp32, identical on every device.

    ``bias_correction=True`` uses ``m / (1 - b1^t)`` and ``v / (1 - b2^tv)`` with
    ``tv = min(t, freeze_step)``, the step at which ``v`` was last updated. Chain it like
    ``optax.scale_by_adam``: ``optax.chain(jc.scale_by_onebit_adam(axis_name="dp"),
    optax.add_decayed_weights(1e-2), optax.scale_by_learning_rate(1e-3))``. The arguments are
    those of :func:`onebit_adam`.
    """
    compressor = OneBit() if compressor is None else compressor
    check_compressor(compressor)
    bucket_bytes = static_bucket_bytes(bucket_bytes)
    static_freeze = static_int(freeze_step)

    def init_fn(params):
        n = resolve_axis_size(axis_name, axis_size)
        mu = zeros_f32(params)
        comm = init_state(compressor, mu, axis_size=n, bucket_bytes=bucket_bytes)
        return OneBitAdamState(jnp.zeros([], jnp.int32), mu, zeros_f32(params), comm)

    def update_fn(updates, state, params=None):
        del params
        grads = f32(updates)
        b1_, b2_ = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)

        def warm(g, mu, nu, comm):
            g = exact_mean(g, axis_name, bucket_bytes)
            return ema(mu, g, b1_), ema(nu, g, b2_, 2), comm

        def compress(g, mu, nu, comm):
            local = ema(mu, g, b1_)
            mu, comm = compressed_mean_call(local, comm, axis_name, compressor, bucket_bytes)
            return mu, nu, comm

        args = (grads, state.mu, state.nu, state.comm)
        if static_freeze is not None and static_freeze <= 0:
            mu, nu, comm = compress(*args)
        else:
            mu, nu, comm = lax.cond(state.count < freeze_step, warm, compress, *args)

        t = optax.safe_increment(state.count)
        m_hat, v_hat = mu, nu
        if bias_correction:
            tv = jnp.maximum(jnp.minimum(t, freeze_step), 1).astype(jnp.float32)
            c1 = 1 - b1_ ** t.astype(jnp.float32)
            c2 = 1 - b2_**tv
            m_hat = jax.tree.map(lambda m: m / c1, mu)
            v_hat = jax.tree.map(lambda v: v / c2, nu)
        eps_ = jnp.asarray(eps, jnp.float32)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps_), m_hat, v_hat)
        return direction, OneBitAdamState(t, mu, nu, comm)

    return optax.GradientTransformation(init_fn, update_fn)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
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

    :func:`scale_by_onebit_adam`'s direction ``d = m / (sqrt(v) + eps)`` (see there for the
    warm-up and compression rules), then ``update = d + weight_decay * p``; the returned optax
    update is ``-lr(count) * update`` in each parameter's dtype (apply it with
    ``optax.apply_updates``).

    Like DeepSpeed there is **no bias correction** by default (DeepSpeed reads the flag and
    ignores it). ``bias_correction=True`` corrects both moments (see
    :func:`scale_by_onebit_adam`).

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
    direction = scale_by_onebit_adam(
        b1,
        b2,
        eps,
        freeze_step,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        axis_size=axis_size,
        bias_correction=bias_correction,
    )
    decay = optax.add_decayed_weights(weight_decay)

    def update_fn(updates, state, params=None):
        needs_params(params, weight_decay, "onebit_adam")
        d, new_state = direction.update(updates, state, params)
        if params is not None:
            d, _ = decay.update(d, decay.init(params), f32(params))
        lr = learning_rate_at(learning_rate, state.count)
        out = jax.tree.map(lambda x: -lr * x, d)
        return cast_like(out, updates if params is None else params), new_state

    return optax.GradientTransformation(direction.init, update_fn)
