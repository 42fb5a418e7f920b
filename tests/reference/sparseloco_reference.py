"""Independent NumPy model of SparseLoCo's compressed mean (arXiv 2508.15706).

Written from the algorithm's description (``/work/shared/reference/frontier.md`` section 1:
the reference code's chunking, top-k, statistical quantizer and scatter-mean), not from
jaxcomm's code. Element-wise steps run in float32 with the operations the rules name, so that
the top-k choices and quantization codes match; means are taken in float64.

Per device ``r`` and tensor (all devices at once):

1. ``e_r <- beta e_r + x_r``.
2. Chunks: the tensor as a matrix (``(1, size)`` for vectors, ``(shape[0], rest)`` above two
   dims), tiles ``h x w`` with ``h``, ``w`` the largest divisors ``<= chunk_size`` of the
   dimensions (``h = 1`` for vectors); ``k = max(1, round(h w top_k / chunk_size^2))`` entries of
   largest ``|e_r|`` per tile.
3. Kept values ``v``: ``shift = mean(v)``, ``c = v - shift``, ``sigma = |c| / sqrt(m - 1)``,
   ``scale = range sigma / B`` (1 if 0 or not finite), ``q = clip(round(c / scale + B/2), 0,
   B - 1)``, ``codebook[b] = mean(c[q == b])`` (0 if empty); ``deq = codebook[q] + shift``.
4. ``e_r[kept] -= deq``.
5. Output: at each entry, the sum of the ``deq`` sent for it over the devices that sent one,
   divided by their number (``contributors``) or by ``n`` (``all``); 0 where none sent.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def tiles(shape, chunk_size):
    """``(rows, cols, h, w)`` of a tensor's tiling."""
    size = int(np.prod(shape))
    if len(shape) >= 2:
        rows, cols = shape[0], size // shape[0]
        return rows, cols, divisor(rows, chunk_size), divisor(cols, chunk_size)
    return 1, size, 1, divisor(size, chunk_size)


def kept_positions(e: np.ndarray, shape, chunk_size: int, top_k: int) -> np.ndarray:
    """Flat positions of the top-k entries of every tile, tile by tile, largest first."""
    rows, cols, h, w = tiles(shape, chunk_size)
    k = min(h * w, max(1, round(h * w * top_k / chunk_size**2)))
    mat = e.reshape(rows, cols)
    out = []
    for ti in range(rows // h):
        for tj in range(cols // w):
            r, c = np.meshgrid(
                np.arange(ti * h, ti * h + h), np.arange(tj * w, tj * w + w), indexing="ij"
            )
            flat_pos = (r * cols + c).reshape(-1)
            mags = np.abs(mat[r, c].reshape(-1))
            order = np.argsort(-mags, kind="stable")[:k]
            out.append(flat_pos[order])
    return np.concatenate(out)


def quantize(v: np.ndarray, bits: int, quant_range: float):
    """``(q, deq)`` of one tensor's kept values."""
    bins = 2**bits
    v = v.astype(F32)
    shift = F32(np.mean(v.astype(np.float64)))
    c = (v - shift).astype(F32)
    m = len(v)
    if m > 1:
        sigma = F32(np.sqrt(np.sum(c.astype(np.float64) ** 2))) / F32(np.sqrt(m - 1))
        scale = F32(F32(quant_range) * sigma) / F32(bins)
        if scale == 0 or not np.isfinite(scale):
            scale = F32(1)
    else:
        scale = F32(1)
    q = np.clip(np.round(c / scale + F32(bins // 2)), 0, bins - 1).astype(np.int64)
    codebook = np.zeros(bins, F32)
    for b in range(bins):
        if np.any(q == b):
            codebook[b] = F32(np.mean(c[q == b].astype(np.float64)))
    return q, (codebook[q] + shift).astype(F32)


class SparseLoCoModel:
    """Stateful compressed mean of ``n`` devices' trees (dicts of float32 arrays)."""

    def __init__(self, n, shapes, top_k, chunk_size=64, bits=2, error_decay=0.999,
                 quant_range=6.0, aggregate="contributors"):  # fmt: skip
        self.n, self.shapes = n, dict(shapes)
        self.top_k, self.chunk_size, self.bits = top_k, chunk_size, bits
        self.beta, self.quant_range, self.aggregate = F32(error_decay), quant_range, aggregate
        self.error = {k: np.zeros((n, int(np.prod(s))), F32) for k, s in self.shapes.items()}

    def sent(self, xs: dict) -> dict:
        """Per tensor, per device: ``(positions, dequantized values)``; updates the errors."""
        out = {}
        for name, shape in self.shapes.items():
            per_device = []
            for r in range(self.n):
                e = (self.beta * self.error[name][r] + xs[name][r].reshape(-1)).astype(F32)
                pos = kept_positions(e, shape, self.chunk_size, self.top_k)
                _, deq = quantize(e[pos], self.bits, self.quant_range)
                e[pos] = (e[pos] - deq).astype(F32)
                self.error[name][r] = e
                per_device.append((pos, deq))
            out[name] = per_device
        return out

    def step(self, xs: dict) -> dict:
        """The aggregated mean of one step (float64)."""
        out = {}
        for name, parts in self.sent(xs).items():
            size = self.error[name].shape[1]
            total, count = np.zeros(size), np.zeros(size)
            for pos, deq in parts:
                total[pos] += deq
                count[pos] += 1
            mean = total / self.n if self.aggregate == "all" else total / np.maximum(count, 1)
            out[name] = mean.reshape(self.shapes[name])
        return out
