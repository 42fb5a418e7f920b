"""Independent NumPy model of DeepSpeed's 1-bit compressed all-reduce (``compressed_allreduce``).

Written from the algorithm's description, not from jaxcomm's code, so tests can compare the two.
All ``n`` devices are simulated at once, in float64.

For one bucket flattened to length ``N`` and zero-padded to ``Np = ceil(N / (8n)) * 8n``, with
per-device state ``worker_error (Np,)`` and ``server_error (Np/n,)``:

1. ``buf = pad(x) + worker_error``; ``s_w = ||buf|| / sqrt(Np)``;
   ``worker_error = buf - s_w * sgn(buf)``, ``sgn(v) = +1 if v >= 0 else -1``.
2. Device ``r`` receives chunk ``r`` of every worker's signs and all worker scales.
3. ``c_r = sum_j (s_w[j] / n) * sgn_j[chunk r] + server_error_r``;
   ``s_s = ||c_r|| / sqrt(Np/n)``; ``server_error_r = c_r - s_s * sgn(c_r)``.
4. ``mean = concat_r s_s[r] * sgn(c_r)`` cut to ``N``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sgn(v: np.ndarray) -> np.ndarray:
    """``+1`` where ``v >= 0`` (zero included), ``-1`` elsewhere."""
    return np.where(v >= 0, 1.0, -1.0)


def padded_length(numel: int, n: int) -> int:
    """``ceil(numel / (8 n)) * 8 n``: whole bytes of signs in every device's chunk."""
    return -(-numel // (8 * n)) * 8 * n


def init_state(numel: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zero ``(worker_error, server_error)`` for each of ``n`` devices."""
    p = padded_length(numel, n)
    return [(np.zeros(p), np.zeros(p // n)) for _ in range(n)]


def onebit_allreduce_mean(
    xs: Sequence[np.ndarray], states: Sequence[tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """One 1-bit compressed mean of the flat vectors ``xs[r]`` (one per device).

    Args:
      xs: ``n`` flat arrays of equal length ``N``.
      states: ``n`` pairs ``(worker_error (Np,), server_error (Np/n,))``.

    Returns:
      ``(mean (N,), new states)``; the mean is the same on every device.
    """
    n = len(xs)
    numel = int(np.asarray(xs[0]).size)
    p = padded_length(numel, n)
    chunk = p // n

    signs, scales, worker_errors = [], [], []
    for x, (we, _) in zip(xs, states, strict=True):
        buf = np.pad(np.asarray(x, np.float64).reshape(-1), (0, p - numel)) + we
        scale = np.linalg.norm(buf) / np.sqrt(p)
        signs.append(sgn(buf))
        scales.append(scale)
        worker_errors.append(buf - scale * sgn(buf))

    pieces, server_errors = [], []
    for r in range(n):
        sl = slice(r * chunk, (r + 1) * chunk)
        comp = sum(scales[j] / n * signs[j][sl] for j in range(n)) + states[r][1]
        s_scale = np.linalg.norm(comp) / np.sqrt(chunk)
        pieces.append(s_scale * sgn(comp))
        server_errors.append(comp - s_scale * sgn(comp))

    mean = np.concatenate(pieces)[:numel]
    return mean, list(zip(worker_errors, server_errors, strict=True))


class OneBitAllReduceModel:
    """Stateful convenience over :func:`onebit_allreduce_mean` for ``n`` devices."""

    def __init__(self, n: int, numel: int):
        self.states = init_state(numel, n)

    def step(self, xs: np.ndarray) -> np.ndarray:
        """``xs``: (n, N) local inputs. Returns the (N,) mean every device receives."""
        mean, self.states = onebit_allreduce_mean(list(xs), self.states)
        return mean


class OneBitReduceScatterModel:
    """Stages 1-2 on the rank-major layout: device ``r`` keeps the decompressed mean of its row.

    Each device's buffer is ``(n, C)`` (row ``r`` = its slices for device ``r``), padded to
    ``(n, ceil(C/8)*8)`` and flattened; the worker stage is that of the all-reduce.
    """

    def __init__(self, n: int, row_numel: int):
        self.n = n
        self.row_numel = row_numel
        self.row_padded = -(-row_numel // 8) * 8
        self.worker_error = np.zeros((n, n * self.row_padded))

    def step(self, rows: np.ndarray) -> np.ndarray:
        """``rows``: (n_devices, n, C). Returns (n, C): row ``r`` is device ``r``'s mean."""
        n, cp = self.n, self.row_padded
        mean = np.zeros((n, cp))
        for j in range(n):
            buf = np.zeros((n, cp))
            buf[:, : self.row_numel] = rows[j]
            buf = buf.reshape(-1) + self.worker_error[j]
            scale = np.linalg.norm(buf) / np.sqrt(buf.size)
            self.worker_error[j] = buf - scale * sgn(buf)
            mean += (scale / n) * sgn(buf).reshape(n, cp)
        return mean[:, : self.row_numel]
