"""Independent NumPy model of DeepSpeed's OnebitLamb (``runtime/fp16/onebit/lamb.py``).

Written from the algorithm's description (the project's reference notes and DeepSpeed's step
rules), not from jaxcomm's code, in float64 with Python-float per-parameter coefficients, the way
DeepSpeed computes them. ``n`` devices are simulated at once. Parameters are a list of flat
leaves (DeepSpeed's parameter tensors, in tree order); the momenta of all of them form one flat
vector, 1-bit averaged per bucket by :class:`tests.reference.adam_reference.BucketedOneBit` (one
bucket: DeepSpeed's single fused buffer).

Conventions shared with jaxcomm (stated in its docstring): ``t`` counts real updates from 1
(DeepSpeed's first ``step()`` only allocates buffers; that quirk is not modelled), so the warm-up
is ``t <= freeze_step`` and ``exp_avg_sq_fresh`` is copied at ``t == freeze_step``; the learning
rate of update ``t`` is ``lr(t - 1)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tests.reference.adam_reference import BucketedOneBit, _lr


class OnebitLambModel:
    """DeepSpeed ``OnebitLamb`` over ``n`` devices; ``events`` records which clips fired.

    jaxcomm's own rules (all off by default here): ``variance_floor = f``: after the switch both
    denominators of a leaf, of ``v`` and of ``v_fresh``, are ``max(sqrt(x), f sqrt(mean_leaf(x)))
    + eps``; ``bias_correction``: ``m / (1 - b1^t)``, ``v / (1 - b2^min(t, freeze_step))``,
    ``v_fresh / (1 - b2^t)``; ``precondition``: the 1-bit mean carries the local momenta divided
    by the frozen (floored) denominator and is multiplied back by it, with no scaling
    coefficients.
    """

    def __init__(
        self,
        n: int,
        leaves: Sequence[np.ndarray],
        *,
        lr,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        freeze_step=100000,
        max_coeff=10.0,
        min_coeff=0.01,
        coeff_beta=0.9,
        factor_max=4.0,
        factor_min=0.5,
        factor_threshold=0.1,
        bucket_sizes: Sequence[int] | None = None,
        variance_floor: float | None = None,
        bias_correction=False,
        precondition=False,
    ):
        self.n = n
        self.floor, self.bias_correction, self.precondition = (
            variance_floor,
            bias_correction,
            precondition,
        )
        self.sizes = [int(np.asarray(x).size) for x in leaves]
        bounds = np.cumsum([0, *self.sizes])
        self.slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.p = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in leaves])
        self.m = np.zeros_like(self.p)
        self.v = np.zeros_like(self.p)
        self.v_fresh = np.zeros_like(self.p)
        k = len(self.sizes)
        self.coeff_freeze = [0.0] * k
        self.last_factor = [1.0] * k
        self.scaling_coeff: list[float] | None = None
        self.t = 0
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay
        self.freeze_step = freeze_step
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        self.onebit = BucketedOneBit(n, bucket_sizes or [self.p.size])
        self.events: set[str] = set()
        self.lamb_coeffs: list[float] = []  # the coefficients of the last step, per leaf

    def step(self, grads: np.ndarray) -> np.ndarray:
        """``grads``: ``(n, N)`` local gradients. Returns the (shared) flat parameters."""
        grads = np.asarray(grads, np.float64)
        lr = _lr(self.lr, self.t)
        self.t += 1
        self.lamb_coeffs = []
        if self.t <= self.freeze_step:
            self._warmup(grads.mean(axis=0), lr)
        else:
            self._compressed(grads, lr)
        return self.p

    def _corr(self) -> tuple[float, float, float]:
        if not self.bias_correction:
            return 1.0, 1.0, 1.0
        b1, b2, t = self.b1, self.b2, self.t
        return 1 - b1**t, 1 - b2 ** max(min(t, self.freeze_step), 1), 1 - b2**t

    def _denom(self, x: np.ndarray) -> np.ndarray:
        """``sqrt(x) + eps`` of one leaf, floored when ``variance_floor`` is set."""
        root = np.sqrt(x)
        if self.floor and x.size:
            root = np.maximum(root, self.floor * np.sqrt(x.mean()))
        return root + self.eps

    def _warmup(self, g: np.ndarray, lr: float) -> None:
        b1, b2 = self.b1, self.b2
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        if self.t == self.freeze_step:
            self.v_fresh = self.v.copy()
        for i, sl in enumerate(self.slices):
            p = self.p[sl]
            c1, c2, _ = self._corr()
            update = (self.m[sl] / c1) / (np.sqrt(self.v[sl] / c2) + self.eps)
            if self.wd > 0:
                update = update + self.wd * p
            weight_norm = float(np.sqrt(np.sum(p * p)))
            update_norm = float(np.sqrt(np.sum(update * update)))
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = weight_norm / update_norm
                if coeff > self.max_coeff:
                    coeff = self.max_coeff
                    self.events.add("coeff_max")
                if coeff < self.min_coeff:
                    coeff = self.min_coeff
                    self.events.add("coeff_min")
            if coeff == 1.0:
                self.events.add("coeff_one")  # DeepSpeed then leaves the average alone
            else:
                self.coeff_freeze[i] = (
                    self.coeff_beta * self.coeff_freeze[i] + (1 - self.coeff_beta) * coeff
                )
            self.lamb_coeffs.append(coeff)
            self.p[sl] = p - lr * coeff * update

    def _compressed(self, grads: np.ndarray, lr: float) -> None:
        b1, b2 = self.b1, self.b2
        m_last = self.m.copy()
        c1, c2, c2_fresh = self._corr()
        if self.precondition:
            denom = np.concatenate([self._denom(self.v[sl] / c2) for sl in self.slices])
            local = (b1 * self.m[None] + (1 - b1) * grads) / denom[None]
            self.m = self.onebit.mean(local) * denom
        else:
            if self.scaling_coeff is None:  # the first compression update
                scales = [
                    np.linalg.norm(self.m[sl]) / np.sqrt(size)
                    for sl, size in zip(self.slices, self.sizes, strict=True)
                ]
                united = sum(scales) / len(scales)
                self.scaling_coeff = [united / s for s in scales]
            scale = np.concatenate(
                [np.full(size, s) for size, s in zip(self.sizes, self.scaling_coeff, strict=True)]
            )
            local = (b1 * self.m[None] + (1 - b1) * grads) * scale[None]
            self.m = self.onebit.mean(local) / scale
        for i, sl in enumerate(self.slices):
            m, p = self.m[sl], self.p[sl]
            g_rec = (m - m_last[sl] * b1) / (1 - b1)
            self.v_fresh[sl] = b2 * self.v_fresh[sl] + (1 - b2) * g_rec * g_rec
            denom = self._denom(self.v[sl] / c2)
            prelim = (m / c1) / denom
            update = prelim + self.wd * p if self.wd > 0 else prelim
            update_norm = float(np.sqrt(np.sum(update * update)))
            denom_real = self._denom(self.v_fresh[sl] / c2_fresh)
            factor = float(np.max(denom / denom_real))
            if self.wd > 0:
                ratio = min(1.0, float(np.sqrt(np.sum(prelim * prelim))) / update_norm)
                factor = factor * ratio + (1.0 - ratio)
            if factor > self.factor_max:
                factor = self.factor_max
                self.events.add("factor_max")
            if factor < self.factor_min:
                factor = self.factor_min
                self.events.add("factor_min")
            last = self.last_factor[i]
            if factor > last * (1.0 + self.factor_threshold):
                factor = last * (1.0 + self.factor_threshold)
                self.events.add("threshold_up")
            if factor < last * (1.0 - self.factor_threshold):
                factor = last * (1.0 - self.factor_threshold)
                self.events.add("threshold_down")
            self.last_factor[i] = factor
            coeff = self.coeff_freeze[i] * factor
            self.lamb_coeffs.append(coeff)
            self.p[sl] = p - lr * coeff * update
