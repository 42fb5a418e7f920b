"""Independent NumPy model of DeMo (arXiv 2411.19870), the reference code's rules.

Written from the algorithm's description (``/work/shared/reference/frontier.md`` section 2), not
from jaxcomm's code; the DCT is ``scipy.fft.dctn(norm="ortho")`` (orthonormal DCT-II) of each
tile, in float64. Elementwise steps run in float32 as the rules name them.

Per device ``r`` and tensor (all devices at once):

1. ``p <- p (1 - lr wd)``.
2. ``m_r <- beta m_r + lr g_r`` (float32).
3. Chunks: the tensor as a matrix (``(1, size)`` for vectors and scalars, ``(shape[0], rest)``
   above two dims), tiles ``h x w`` with ``h``, ``w`` the largest divisors ``<= chunk_size`` of
   the dimensions (``h = 1`` for vectors); ``C = DCT2(tile)``.
4. ``k = min(top_k, h w)`` coefficients of largest ``|C|`` per tile, sent in float32.
5. ``m_r <- m_r - IDCT2(sent)``.
6. ``S``: at each coefficient the mean of the values sent for it over the devices that sent
   one, 0 elsewhere; ``U = IDCT2(S)``; ``p <- p - lr sign(U)``.
"""

from __future__ import annotations

import numpy as np
from scipy.fft import dctn, idctn

from tests.reference.sparseloco_reference import (
    tiles,  # the same chunking rule (frontier.md section 1)
)

F32 = np.float32


def tile_views(shape, chunk_size):
    """Each tile's ``(row slice, col slice)`` in the ``(rows, cols)`` matrix view."""
    rows, cols, h, w = tiles(shape, chunk_size)
    return [
        (slice(i, i + h), slice(j, j + w)) for i in range(0, rows, h) for j in range(0, cols, w)
    ]


class DemoModel:
    """DeMo over ``n`` devices' gradients (dicts of ``(n, *shape)`` float32 arrays)."""

    def __init__(self, n, shapes, lr, beta=0.999, top_k=32, chunk_size=64, wd=0.0):
        self.n, self.shapes = n, dict(shapes)
        self.lr, self.beta, self.wd = F32(lr), F32(beta), F32(wd)
        self.top_k, self.chunk_size = top_k, chunk_size
        self.m = {k: np.zeros((n, *s), F32) for k, s in self.shapes.items()}
        self.scale = {}  # per tensor, the largest |m| before the last step's removal

    def step(self, params: dict, grads: dict) -> tuple[dict, dict]:
        """``(new params (float32 unless given in another dtype), U (float64))``."""
        new_params, directions = {}, {}
        for name, shape in self.shapes.items():
            rows, cols, h, w = tiles(shape, self.chunk_size)
            k = min(self.top_k, h * w)
            total, count = np.zeros((rows, cols)), np.zeros((rows, cols))
            self.scale[name] = 0.0
            for r in range(self.n):
                m = (self.beta * self.m[name][r] + self.lr * grads[name][r]).astype(F32)
                mat = m.reshape(rows, cols).astype(np.float64)
                self.scale[name] = max(self.scale[name], float(np.abs(mat).max()))
                removed = np.zeros((rows, cols))
                for rs, cs in tile_views(shape, self.chunk_size):
                    c = dctn(mat[rs, cs], norm="ortho")
                    keep = np.argsort(-np.abs(c).reshape(-1), kind="stable")[:k]
                    sent = np.zeros(h * w)
                    sent[keep] = c.reshape(-1)[keep].astype(F32)
                    sent = sent.reshape(h, w)
                    removed[rs, cs] = idctn(sent, norm="ortho")
                    mask = np.zeros(h * w)
                    mask[keep] = 1
                    total[rs, cs] += sent
                    count[rs, cs] += mask.reshape(h, w)
                self.m[name][r] = (mat - removed).astype(F32).reshape(shape)
            mean = total / np.maximum(count, 1)
            u = np.zeros((rows, cols))
            for rs, cs in tile_views(shape, self.chunk_size):
                u[rs, cs] = idctn(mean[rs, cs], norm="ortho")
            p = np.asarray(params[name])
            p32 = p.astype(F32) * (F32(1) - self.lr * self.wd)
            new = p32 - self.lr * np.sign(u).astype(F32).reshape(shape)
            new_params[name] = new.astype(p.dtype)
            directions[name] = u.reshape(shape)
        return new_params, directions
