"""One update of 0/1 Adam (:func:`jaxcomm.optim.zero_one_adam.scale_by_zero_one_adam`) besides
its state: which kind of step it is (:func:`step_kind`), the communication each kind needs
(:func:`var_update`, :func:`onebit_momentum`, :func:`local_step`, :func:`local_step_sync`), what
it does to each leaf (:meth:`ZeroOneStep.apply_leaf`) and DeepSpeed's interval policies."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.compressors import Compressor
from jaxcomm.optim._common import PyTree, compressed_mean_call, exact_mean
from jaxcomm.optim._moments import damped_denominator, ema
from jaxcomm.optim._skip import all_finite, mean_finite
from jaxcomm.optim.schedule import phase, phase_switch


@dataclasses.dataclass(frozen=True)
class ZeroOneStep:
    """What one traced update of 0/1 Adam needs besides the state (constants of the trace)."""

    b1: jax.Array
    b2: jax.Array
    b2_var: jax.Array  # decay of one variance update: b2, or b2^var_interval (interval-weighted)
    eps: jax.Array
    wd: jax.Array
    lr: jax.Array
    t: jax.Array
    var_freeze_step: int | jax.Array
    c1: jax.Array  # bias corrections of m and v (1.0 under deepspeed_compat)
    c2: jax.Array
    first_sync: bool | jax.Array  # the first step after the freeze (a synchronisation)
    floor: float | None
    precondition: bool
    compress_momentum: bool
    params: PyTree | None
    axis_name: str
    compressor: Compressor
    bucket_bytes: int | None
    nu_means: PyTree  # each leaf's mean of the variance the step starts from (the state's)

    def denom(self, v: jax.Array, v_mean: jax.Array | None = None) -> jax.Array:
        """``sqrt(v_hat) + eps``, damped where ``v`` is (near) zero (``variance_floor``);
        ``v_mean``: ``mean(v)`` when known."""
        return damped_denominator(v, self.eps, self.floor, scale=self.c2, mean=v_mean)

    def leaf_step(
        self, m: jax.Array, den: jax.Array | None, p: jax.Array | None
    ) -> jax.Array:
        """``lr * (m_hat / den + wd * p)`` for one leaf (before the sign); ``den=None``: ``m``
        is already ``m / den``."""
        update = m / self.c1 if den is None else (m / self.c1) / den
        if p is not None:
            update = update + self.wd * p
        return self.lr * update

    def params_or_none(self, like: PyTree) -> PyTree:
        """The fp32 parameters, or a ``None`` per leaf of ``like`` (no weight decay)."""
        if self.params is not None:
            return self.params
        return jax.tree.map(lambda _: None, like)

    def adam_step(self, mu: PyTree, nu: PyTree) -> PyTree:
        """``lr * (m_hat / denom(v) + wd * p)`` per leaf (before the sign), ``nu`` the state's."""
        return jax.tree.map(
            lambda m, v, vm, p: self.leaf_step(m, self.denom(v, vm), p),
            mu,
            nu,
            self.nu_means,
            self.params_or_none(mu),
        )

    def onebit_mean(self, tree, comm):
        """The 1-bit mean, the new error feedback and whether the mean is finite (from the
        collectives' guard: no pass over the mean, see ``mean_finite``; typed as varying: the
        step takes one pmin of it with the gradients' flag)."""
        mean, new = compressed_mean_call(
            tree, comm, self.axis_name, self.compressor, self.bucket_bytes
        )
        return mean, new, mean_finite(mean, comm, new, self.axis_name, replicated=False)

    def local_accumulated(self, g, mu, nu, u):
        """``(m_local, step, u - step)`` of a frozen-stage step on this device's gradient."""
        m_local = ema(mu, g, self.b1)
        step = self.adam_step(m_local, nu)
        return m_local, step, jax.tree.map(lambda a, s: a - s, u, step)

    def communicate(self, kind, g, mu, nu, u, comm):
        """The mean each kind of step needs, the new error feedback and whether the mean is
        finite: :func:`var_update`, :func:`onebit_momentum`, :func:`local_step` or
        :func:`local_step_sync` by ``kind`` (``lax.switch``, or the one branch of a
        phase-specialised step).

        Only the communication is in the switch: state that passes through a ``lax.cond`` or
        ``lax.switch`` and is read after it is copied by XLA in every branch, so the moments,
        the accumulated updates and the parameters are updated after it (:meth:`apply_leaf`),
        elementwise in their own buffers.
        """
        branches = (var_update, onebit_momentum, local_step, local_step_sync)
        branches = tuple(shaped_like_g(partial(b, self)) for b in branches)
        return phase_switch(kind, branches, g, mu, nu, u, comm)

    def denoms(self, nu: PyTree) -> PyTree:
        """The denominators of the variance the step starts from (``nu``, the state's)."""
        return jax.tree.map(self.denom, nu, self.nu_means)

    def apply_leaf(self, kind, ok, g, mu, nu_new, nu_mean, u, mean, p, lrs_sync):
        """One leaf's new ``(m, u, delta)`` for the kind of step (``ok`` false: ``m``, ``u`` kept,
        ``delta = 0``). ``nu_new`` is the variance after this step and ``nu_mean`` its mean,
        ``mean`` the switch's. ``m`` and ``u`` keep their layout (blocks or not), ``delta`` is
        shaped like ``g``."""
        m, u_, delta = self._apply_leaf(kind, ok, g, mu, nu_new, nu_mean, u, mean, p, lrs_sync)
        return m, u_, delta.reshape(g.shape)

    def _apply_leaf(self, kind, ok, g, mu, nu_new, nu_mean, u, mean, p, lrs_sync):
        den = self.denom(nu_new, nu_mean)

        def step_of(m):
            return self.leaf_step(m, den, p)

        if isinstance(kind, int) and kind in (0, 2):  # a phase-specialised variance update
            # or local step: the new m (of the exact mean gradient, or of this device's) is
            # written over the old in place and the step read from it (the barrier orders the
            # two): a step that read the old m besides would make XLA copy m.
            new_m = lax.optimization_barrier(
                jnp.where(ok, ema(mu, mean if kind == 0 else g, self.b1), mu)
            )
            step = step_of(new_m)
            new_u = u if kind == 0 else jnp.where(ok, u - step, u)  # only local steps accumulate
            return new_m, new_u, jnp.where(ok, -step, jnp.zeros_like(step))

        # Kind 0, variance update: the exact mean gradient updates m (and v, before this).
        m_var = ema(mu, mean, self.b1)
        # Kind 1, 1-bit momentum: the mean (mapped back by the denominator) is m, or updates it.
        mapped = mean * den if self.precondition else mean
        m_onebit = mapped if self.compress_momentum else ema(mu, mapped, self.b1)
        # Kinds 2 and 3: the local step on this device's gradient, accumulated in u.
        m_local = ema(mu, g, self.b1)
        step = step_of(m_local)
        u_acc = u - step
        # Kind 3, synchronisation: the mean accumulated update replaces the local ones; its
        # momentum-space mean is of m_hat = m / c1, so times c1 it is m (DeepSpeed: c1 = 1).
        # DeepSpeed's p - lr*update - (u - lr*update) + avg / denom is p - u + avg / denom:
        # written so, the step reads neither the gradient nor the momentum again (the local
        # step's terms cancel, up to rounding). Preconditioned, avg / denom is the mean itself.
        avg = mapped
        m_sync = -avg / lrs_sync * self.c1
        sync_delta = (mean if self.precondition else avg / den) - u

        # Preconditioned, the 1-bit momentum's m / den is the mean itself: its step need not
        # read the variance (the momentum, mean * den, does).
        if self.precondition and self.compress_momentum:
            onebit_step = self.leaf_step(mean, None, p)
        else:
            onebit_step = step_of(m_onebit)
        new_m = by_kind(kind, (m_var, m_onebit, m_local, m_sync))
        new_u = by_kind(kind, (u, u, u_acc, jnp.zeros_like(u)))
        delta = by_kind(kind, (-step_of(m_var), -onebit_step, -step, sync_delta))
        return (
            jnp.where(ok, new_m, mu),
            jnp.where(ok, new_u, u),
            jnp.where(ok, delta, jnp.zeros_like(delta)),
        )


def step_kind(t: jax.Array, state, var_freeze_step):
    """``(kind, first_sync, frozen, var_step)`` of update ``t`` (1-based) of a
    ``ZeroOneAdamState``: kind 0 a variance update (``t % var_interval == 0`` before the
    freeze), 1 a 1-bit momentum step (the other steps before it), 2 a local step (after it), 3
    a synchronisation (``t % local_interval == 0`` after it); ``first_sync``: the first step
    after the freeze (always a synchronisation), which zeroes the error feedback. Both are
    Python values in a phase-specialised step: the first synchronisation is a phase of its own
    (one program more), so that the others do not select over the error feedback."""
    frozen = t > var_freeze_step
    var_step = (t % state.var_interval) == 0
    sync = (t % state.local_interval) == 0
    first = t == var_freeze_step + 1
    synced = jnp.where(first, 4, 3)
    value = jnp.where(frozen, jnp.where(sync, synced, 2), jnp.where(var_step, 0, 1))
    kind = phase(value.astype(jnp.int32), 5)
    if isinstance(kind, int):
        return min(kind, 3), kind == 4, frozen, var_step
    return jnp.minimum(kind, 3), kind == 4, frozen, var_step


def var_update(step: ZeroOneStep, g, mu, nu, u, comm):
    """Kind 0, variance stage, ``t % var_interval == 0``: the exact mean gradient."""
    mean = exact_mean(g, step.axis_name, step.bucket_bytes)
    return mean, comm, ensure_varying(all_finite(mean), step.axis_name)


def onebit_momentum(step: ZeroOneStep, g, mu, nu, u, comm):
    """Kind 1, variance stage, other steps: the 1-bit mean of the gradients, or with
    ``compress_momentum`` of the local momenta ``b1 m + (1-b1) g_r`` (divided by the
    denominator with ``precondition``)."""
    x = ema(mu, g, step.b1) if step.compress_momentum else g
    if step.precondition:
        x = jax.tree.map(lambda a, d: a / d, x, step.denoms(nu))
    return step.onebit_mean(x, comm)


def local_step(step: ZeroOneStep, g, mu, nu, u, comm):
    """Kind 2, frozen stage, no synchronisation: nothing to send (zeros, replicated like the
    means of the other kinds)."""
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), g)
    return zeros, comm, ensure_varying(jnp.bool_(True), step.axis_name)


def local_step_sync(step: ZeroOneStep, g, mu, nu, u, comm):
    """Kind 3, frozen stage, ``t % local_interval == 0``: the 1-bit mean of the accumulated
    updates (times the denominator unless ``precondition``)."""
    _, _, u = step.local_accumulated(g, mu, nu, u)
    # Zero the error feedback at the variance freeze (the first frozen step is always a
    # synchronisation: local_interval is still 1 then).
    if step.first_sync is not False:
        comm = jax.tree.map(lambda e: jnp.where(step.first_sync, jnp.zeros_like(e), e), comm)
    if not step.precondition:  # DeepSpeed compresses u * denom
        u = jax.tree.map(lambda a, d: a * d, u, step.denoms(nu))
    return step.onebit_mean(u, comm)


def shaped_like_g(branch):
    """The branch, its mean shaped like the gradients (a mean of blocks is blocks)."""

    def run(g, mu, nu, u, comm):
        mean, comm, ok = branch(g, mu, nu, u, comm)
        return jax.tree.map(lambda m, x: m.reshape(x.shape), mean, g), comm, ok

    return run


def by_kind(kind: jax.Array, values) -> jax.Array:
    """``values[kind]`` elementwise (kind a traced int32 scalar in ``[0, len(values))``, or a
    Python int in a phase-specialised step: then the other values are dead code)."""
    if isinstance(kind, int):
        return values[kind]
    out = values[-1]
    for i in range(len(values) - 2, -1, -1):
        out = jnp.where(kind == i, values[i], out)
    return out


def intervals(state, t, frozen, var_step, scalers) -> dict:
    """DeepSpeed's interval policies (of a ``ZeroOneAdamState``), applied after the update."""
    var_update_scaler, local_step_scaler, local_step_clipper = scalers
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
    return dict(
        var_interval=var_interval.astype(jnp.int32),
        var_counter=var_counter,
        local_interval=local_interval.astype(jnp.int32),
        local_counter=local_counter,
    )
