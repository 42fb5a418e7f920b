"""Independent NumPy model of blockwise int8/int4 quantized all-reduce (ZeRO++ qgZ rules).

Written from the algorithm's description (``/work/shared/reference/algorithms.md``, ZeRO++),
not from jaxcomm's code. It runs in float32, with the same IEEE operations the rules name, so
quantization codes can be compared exactly.

Quantizer, per block: ``scale = 2^b / (2 absmax)`` (1 when absmax is 0),
``q = clamp(round_half_even(x * scale), -2^(b-1), 2^(b-1) - 1)``, stored ``1/scale``,
``deq = q * (1/scale)``.

Layout: chunk length ``ceil(N / n)`` split into ``B = ceil(chunk / block_size)`` blocks of
``L = ceil(chunk / B)`` (even for int4); the bucket is zero-padded to ``n B L``.

All-reduce (mean), all ``n`` devices at once:
1. ``buf_j = pad(x_j) + e_w[j]``; ``e_w[j] = buf_j - deq(q(buf_j))``.
2. device ``r`` gets chunk ``r`` of every ``deq(q(buf_j))``;
   ``m_r = sum_j q_j * (inv_j / n) + e_s[r]``; ``e_s[r] = m_r - deq(q(m_r))``.
3. output ``concat_r deq(q(m_r))`` cut to ``N``.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def layout(chunk: int, block_size: int, bits: int) -> tuple[int, int]:
    blocks = max(1, -(-chunk // block_size))
    length = max(1, -(-chunk // blocks))
    if bits == 4 and length % 2:
        length += 1
    return blocks, length


def quantize(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``blocks`` (float32) -> int codes and per-row ``1/scale`` (float32)."""
    blocks = np.asarray(blocks, F32)
    absmax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        scale = np.where(absmax == 0, F32(1), F32(2**bits) / (F32(2) * absmax)).astype(F32)
    half = 2 ** (bits - 1)
    q = np.clip(np.round(blocks * scale[..., None]), -half, half - 1).astype(np.int64)
    return q, (F32(1) / scale).astype(F32)


def dequantize(q: np.ndarray, inv: np.ndarray) -> np.ndarray:
    return (q.astype(F32) * inv[..., None]).astype(F32)


class QuantizeAllReduceModel:
    """Stateful mean all-reduce of ``n`` devices' flat vectors of length ``numel``."""

    def __init__(self, n: int, numel: int, bits: int, block_size: int, error_feedback: bool):
        self.n, self.numel, self.bits = n, numel, bits
        self.blocks, self.length = layout(-(-numel // n), block_size, bits)
        self.chunk = self.blocks * self.length
        self.ef = error_feedback
        self.worker_error = np.zeros((n, n * self.chunk), F32)
        self.server_error = np.zeros((n, self.chunk), F32)

    def step(self, xs: np.ndarray) -> np.ndarray:
        n, b, nb, ln = self.n, self.bits, self.blocks, self.length
        bufs = np.zeros((n, n * self.chunk), F32)
        bufs[:, : self.numel] = np.asarray(xs, F32).reshape(n, -1)
        if self.ef:
            bufs = bufs + self.worker_error
        q, inv = quantize(bufs.reshape(n, n, nb, ln), b)  # [device, chunk, block, :]
        if self.ef:
            self.worker_error = bufs - dequantize(q, inv).reshape(n, -1)
        out = np.zeros((n, self.chunk), F32)
        for r in range(n):
            m = np.zeros((nb, ln), F32)
            for j in range(n):  # chunk r of device j, in device order
                m = m + q[j, r].astype(F32) * (inv[j, r] / F32(n))[:, None]
            if self.ef:
                m = m + self.server_error[r].reshape(nb, ln)
            qs, invs = quantize(m, b)
            deq = dequantize(qs, invs)
            if self.ef:
                self.server_error[r] = (m - deq).reshape(-1)
            out[r] = deq.reshape(-1)
        return out.reshape(-1)[: self.numel]


def quantize_reduce_scatter_mean(rows: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """No feedback: device ``r``'s ``(C,)`` row of the mean of ``rows[j] (n, C)``."""
    rows = np.asarray(rows, F32)
    n, _, width = rows.shape
    nb, ln = layout(width, block_size, bits)
    padded = np.zeros((n, n, nb * ln), F32)
    padded[:, :, :width] = rows
    q, inv = quantize(padded.reshape(n, n, nb, ln), bits)
    out = np.zeros((n, nb * ln), F32)
    for r in range(n):
        m = np.zeros((nb, ln), F32)
        for j in range(n):
            m = m + q[j, r].astype(F32) * (inv[j, r] / F32(n))[:, None]
        out[r] = m.reshape(-1)
    return out[:, :width]


def quantize_all_gather(rows: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """qwZ: each device's ``(C,)`` row quantized blockwise and dequantized."""
    rows = np.asarray(rows, F32)
    n, width = rows.shape
    nb, ln = layout(width, block_size, bits)
    padded = np.zeros((n, nb * ln), F32)
    padded[:, :width] = rows
    q, inv = quantize(padded.reshape(n, nb, ln), bits)
    return dequantize(q, inv).reshape(n, -1)[:, :width]
