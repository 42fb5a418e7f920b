"""Independent NumPy model of torch's ``powerSGD_hook`` on one bucket, all devices at once.

Written from the algorithm's description (``/work/shared/reference/algorithms.md``, PyTorch
PowerSGD), in float64. Per step, with ``n`` devices and per-device flat inputs ``x_j``:

1. ``c_j = x_j + e_j``. Leaf ``i`` (shape ``s``) is the matrix ``(s[0], prod(s[1:]))`` with
   ``r = min(rows, cols, rank)``; compressed iff ``len(s) >= 2`` and
   ``(rows + cols) r * min_rate < rows cols``; the rest are all-reduced exactly.
2. ``Q`` given (warm start: last step's all-reduced Q; else a fresh draw), orthogonalized by
   Gram-Schmidt.
3. ``P = sum_j M_j Q``; orthogonalize ``P``; ``Q = sum_j M_j^T P``;
   ``mean = P Q^T / n`` (exact leaves: ``sum_j / n``).
4. ``e_j = c_j - mean``.
"""

from __future__ import annotations

import math

import numpy as np


def gram_schmidt(m: np.ndarray) -> np.ndarray:
    m = np.array(m, np.float64)
    for i in range(m.shape[1]):
        norm = np.linalg.norm(m[:, i])
        m[:, i] = m[:, i] / norm if norm > 0 else 0.0
        for k in range(i + 1, m.shape[1]):
            m[:, k] -= np.dot(m[:, i], m[:, k]) * m[:, i]
    return m


def leaf_matrices(shapes, rank: int, min_rate: float):
    """``(rows, cols, r)`` per leaf, ``r = 0`` for leaves sent exactly."""
    out = []
    for s in shapes:
        size = math.prod(s)
        rows = s[0] if s else 1
        cols = size // rows if rows else 0
        r = min(rows, cols, rank)
        ok = len(s) >= 2 and (rows + cols) * r * min_rate < rows * cols
        out.append((rows, cols, r if ok else 0))
    return out


class PowerSGDModel:
    def __init__(self, n, shapes, rank, min_rate=2.0, error_feedback=True, initial_qs=None):
        self.n, self.shapes, self.ef = n, shapes, error_feedback
        self.plan = leaf_matrices(shapes, rank, min_rate)
        self.numel = sum(math.prod(s) for s in shapes)
        self.errors = np.zeros((n, self.numel))
        self.qs = None if initial_qs is None else [np.asarray(q, np.float64) for q in initial_qs]

    def step(self, xs: np.ndarray, qs=None) -> np.ndarray:
        """``xs`` (n, N) -> mean (N,). ``qs``: this step's Q per compressed leaf (no warm start)."""
        n = self.n
        c = np.asarray(xs, np.float64).reshape(n, -1) + (self.errors if self.ef else 0)
        qs = self.qs if qs is None else [np.asarray(q, np.float64) for q in qs]
        out = np.zeros(self.numel)
        new_qs, k, off = [], 0, 0
        for s, (rows, cols, r) in zip(self.shapes, self.plan, strict=True):
            size = math.prod(s)
            block = c[:, off : off + size]
            if r:
                q = gram_schmidt(qs[k])
                ms = block.reshape(n, rows, cols)
                p = gram_schmidt(sum(m @ q for m in ms))
                q = sum(m.T @ p for m in ms)
                out[off : off + size] = (p @ q.T).reshape(-1) / n
                new_qs.append(q)
                k += 1
            else:
                out[off : off + size] = block.sum(0) / n
            off += size
        self.qs = new_qs
        if self.ef:
            self.errors = c - out
        return out
