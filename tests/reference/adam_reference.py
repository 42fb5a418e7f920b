"""Independent NumPy models of DeepSpeed's OnebitAdam and ZeroOneAdam, ``n`` devices at once.

Written from the algorithms' description (DeepSpeed ``runtime/fp16/onebit/adam.py`` and
``zoadam.py``, as summarised in the project's reference notes), not from jaxcomm's code, in
float64. Parameters are one flat vector (the tree's leaves concatenated in tree order); the 1-bit
all-reduce is :mod:`tests.reference.onebit_reference`'s, applied per bucket (``bucket_sizes``
splits the flat vector into consecutive buckets; one bucket is jaxcomm's ``bucket_bytes=None``).

Conventions shared with jaxcomm (and stated in its docstrings): ``t`` counts real updates from 1
(DeepSpeed's first ``step()`` only allocates buffers; that quirk is not modelled); the learning
rate of update ``t`` is ``lr(t - 1)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tests.reference.onebit_reference import init_state as onebit_init_state
from tests.reference.onebit_reference import onebit_allreduce_mean


def _lr(lr: float | Callable, count: int) -> float:
    return float(lr(count)) if callable(lr) else float(lr)


class BucketedOneBit:
    """1-bit compressed mean of ``(n, N)`` flat inputs, bucket by bucket, with error feedback."""

    def __init__(self, n: int, bucket_sizes: Sequence[int]):
        self.n = n
        self.sizes = list(bucket_sizes)
        self.reset()

    def reset(self) -> None:
        """Zero every device's worker and server error."""
        self.states = [onebit_init_state(size, self.n) for size in self.sizes]

    def mean(self, xs: np.ndarray) -> np.ndarray:
        out, start = [], 0
        for b, size in enumerate(self.sizes):
            part = [x[start : start + size] for x in xs]
            mean, self.states[b] = onebit_allreduce_mean(part, self.states[b])
            out.append(mean)
            start += size
        return np.concatenate(out)


def floored_root(v: np.ndarray, leaf_sizes, floor: float) -> np.ndarray:
    """``max(sqrt(v), floor * sqrt(mean_leaf(v)))`` leaf by leaf over the flat ``v``: the
    variance floor of jaxcomm's 1-bit optimizers."""
    parts, start = [], 0
    for size in leaf_sizes:
        leaf = v[start : start + size]
        parts.append(np.maximum(np.sqrt(leaf), floor * np.sqrt(leaf.mean())))
        start += size
    return np.concatenate(parts)


class OnebitAdamModel:
    """DeepSpeed ``OnebitAdam``: exact warm-up for ``freeze_step`` updates, then 1-bit momentum.

    Warm-up (``t <= freeze_step``): ``g = mean_r g_r``; ``m = b1 m + (1-b1) g``;
    ``v = b2 v + (1-b2) g^2``. Compression: ``m_r = b1 m + (1-b1) g_r``; ``m = 1bit-mean(m_r)``;
    ``v`` frozen. Then ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``. DeepSpeed applies no bias
    correction; with ``bias_correction`` ``m / (1 - b1^t)`` and ``v / (1 - b2^min(t, freeze))``.

    jaxcomm's safe defaults (not DeepSpeed's): after the freeze, with ``variance_floor = f``, the
    denominator of each leaf (``leaf_sizes`` splits the flat vector) is ``max(sqrt(v), f *
    sqrt(mean_leaf(v))) + eps``; ``mask`` (flat, 0/1) multiplies the 1-bit mean momentum;
    ``precondition``: the 1-bit mean carries ``m_r / denom`` and is multiplied back by ``denom``.
    """

    def __init__(
        self,
        n: int,
        params: np.ndarray,
        *,
        lr,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        freeze_step=100000,
        bias_correction=False,
        bucket_sizes: Sequence[int] | None = None,
        variance_floor: float | None = None,
        leaf_sizes: Sequence[int] | None = None,
        mask: np.ndarray | None = None,
        precondition: bool = False,
    ):
        self.n = n
        self.precondition = precondition
        self.p = np.asarray(params, np.float64).copy()
        self.floor, self.mask = variance_floor, mask
        self.leaf_sizes = list(leaf_sizes or [self.p.size])
        self.m = np.zeros_like(self.p)
        self.v = np.zeros_like(self.p)
        self.t = 0
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay
        self.freeze_step = freeze_step
        self.bias_correction = bias_correction
        self.onebit = BucketedOneBit(n, bucket_sizes or [self.p.size])

    def step(self, grads: np.ndarray) -> np.ndarray:
        """``grads``: ``(n, N)`` local gradients. Returns the (shared) parameters."""
        grads = np.asarray(grads, np.float64)
        lr = _lr(self.lr, self.t)
        self.t += 1
        if self.t <= self.freeze_step:
            g = grads.mean(axis=0)
            self.m = self.b1 * self.m + (1 - self.b1) * g
            self.v = self.b2 * self.v + (1 - self.b2) * g * g
        else:
            local = self.b1 * self.m[None] + (1 - self.b1) * grads
            if self.precondition:
                denom = self.denominator()
                self.m = self.onebit.mean(local / denom[None]) * denom
            else:
                self.m = self.onebit.mean(local)
            if self.mask is not None:
                self.m = self.m * self.mask
        m = self.m / (1 - self.b1**self.t) if self.bias_correction else self.m
        update = m / self.denominator() + self.wd * self.p
        self.p = self.p - lr * update
        return self.p

    def denominator(self) -> np.ndarray:
        """``sqrt(v_hat) + eps``, floored after the freeze."""
        v = self.v
        if self.bias_correction:
            v = v / (1 - self.b2 ** max(min(self.t, self.freeze_step), 1))
        root = np.sqrt(v)
        if self.floor and self.t > self.freeze_step:
            root = floored_root(v, self.leaf_sizes, self.floor)
        return root + self.eps


class ZeroOneAdamModel:
    """DeepSpeed ``ZeroOneAdam`` with per-device parameters ``p[r]``.

    Variance stage (``t <= var_freeze_step``): if ``t % var_interval == 0`` the exact mean
    gradient updates ``m`` and ``v``, else the 1-bit mean of the gradients updates ``m``; every
    device takes the same step. After each variance update ``var_counter`` counts up; at
    ``var_update_scaler`` it resets and ``var_interval`` doubles.

    Frozen stage (errors zeroed first): each device ``m_r = b1 m_r + (1-b1) g_r``, ``lrs += lr``,
    ``p_r -= lr * upd_r``, ``u_r -= lr * upd_r``; every ``local_interval`` steps:
    ``p_r -= u_r``, ``u_r *= sqrt(v) + eps``, ``u = 1bit-mean(u_r)``, ``m_r = -u / lrs``,
    ``p_r += u / (sqrt(v) + eps)``, ``u_r = 0``, ``lrs = 0``; then ``local_counter`` counts up
    and at ``local_step_scaler`` resets, ``local_interval = min(clipper, 2 * local_interval)``.

    jaxcomm's own rules (not DeepSpeed's; all off by default here): ``bias_correction`` divides
    ``m`` by ``1 - b1^t`` and ``v`` by ``1 - b2^s`` with ``s`` the steps covered by ``v``'s
    updates (one per update, or ``var_interval`` per update with ``interval_weighted_variance``,
    whose update is then ``v = b2^k v + (1 - b2^k) g^2`` with ``k = var_interval``); the synced
    momentum is ``-c1 u / lrs``. ``variance_floor = f``: every denominator is ``max(sqrt(v),
    f sqrt(mean_leaf(v))) + eps`` per leaf (``leaf_sizes``). ``compress_momentum``: the variance
    stage's 1-bit steps average the local momenta ``b1 m + (1-b1) g_r`` instead of the gradients.
    ``precondition``: those 1-bit means carry ``x / denom`` and are multiplied back by ``denom``;
    a synchronisation averages ``u_r`` itself and multiplies the mean by ``denom``.
    """

    def __init__(
        self,
        n: int,
        params: np.ndarray,
        *,
        lr,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        var_freeze_step=100000,
        var_update_scaler=16,
        local_step_scaler=32678,
        local_step_clipper=16,
        bucket_sizes: Sequence[int] | None = None,
        bias_correction=False,
        variance_floor: float | None = None,
        leaf_sizes: Sequence[int] | None = None,
        compress_momentum=False,
        precondition=False,
        interval_weighted_variance=False,
    ):
        self.n = n
        p = np.asarray(params, np.float64)
        self.bias_correction, self.floor = bias_correction, variance_floor
        self.leaf_sizes = list(leaf_sizes or [p.size])
        self.compress_momentum, self.precondition = compress_momentum, precondition
        self.interval_weighted = interval_weighted_variance
        self.var_steps = 0  # steps covered by the updates of v (its bias correction)
        self.p = np.stack([p.copy() for _ in range(n)])
        self.m = np.zeros_like(self.p)
        self.u = np.zeros_like(self.p)
        self.v = np.zeros_like(p)
        self.lrs = 0.0
        self.t = 0
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.onebit = BucketedOneBit(n, bucket_sizes or [p.size])
        self.branches: list[str] = []  # which rule each step took, for the tests' coverage check

    def _corrections(self) -> tuple[float, float]:
        if not self.bias_correction:
            return 1.0, 1.0
        return 1 - self.b1**self.t, 1 - self.b2 ** max(self.var_steps, 1)

    def _denom(self) -> np.ndarray:
        v = self.v / self._corrections()[1]
        root = floored_root(v, self.leaf_sizes, self.floor) if self.floor else np.sqrt(v)
        return root + self.eps

    def _update(self) -> np.ndarray:
        return (self.m / self._corrections()[0]) / self._denom() + self.wd * self.p

    def _onebit(self, xs: np.ndarray) -> np.ndarray:
        """1-bit mean of ``(n, N)`` inputs, preconditioned by the denominator if asked."""
        if not self.precondition:
            return self.onebit.mean(xs)
        denom = self._denom()
        return self.onebit.mean(xs / denom[None]) * denom

    def step(self, grads: np.ndarray) -> np.ndarray:
        """``grads``: ``(n, N)`` local gradients. Returns the ``(n, N)`` per-device parameters."""
        grads = np.asarray(grads, np.float64)
        lr = _lr(self.lr, self.t)
        self.t += 1
        t = self.t
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                g = grads.mean(axis=0)
                k = self.var_interval if self.interval_weighted else 1
                decay = self.b2**k
                self.m = self.b1 * self.m + (1 - self.b1) * g[None]
                self.v = decay * self.v + (1 - decay) * g * g
                self.var_steps += k
                self.branches.append("variance")
            elif self.compress_momentum:
                local = self.b1 * self.m + (1 - self.b1) * grads
                self.m = np.broadcast_to(self._onebit(local), self.p.shape).copy()
                self.branches.append("onebit")
            else:
                g = self._onebit(grads)
                self.m = self.b1 * self.m + (1 - self.b1) * g[None]
                self.branches.append("onebit")
            self.p = self.p - lr * self._update()
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
            return self.p

        if t == self.var_freeze_step + 1:
            self.onebit.reset()
        self.m = self.b1 * self.m + (1 - self.b1) * grads
        self.lrs += lr
        step = lr * self._update()
        self.p = self.p - step
        self.u = self.u - step
        if t % self.local_interval == 0:
            self.p = self.p - self.u
            denom = self._denom()
            if self.precondition:
                avg = self.onebit.mean(self.u) * denom
            else:
                avg = self.onebit.mean(self.u * denom[None])
            c1 = self._corrections()[0]
            self.m = np.broadcast_to(-avg / self.lrs * c1, self.p.shape).copy()
            self.p = self.p + (avg / denom)[None]
            self.u = np.zeros_like(self.u)
            self.lrs = 0.0
            self.branches.append("sync")
        else:
            self.branches.append("local")
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, 2 * self.local_interval)
        return self.p
