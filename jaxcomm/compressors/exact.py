"""The exact mean: :class:`NoCompression`, and its stages (:class:`ExactCodec`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.compressors._base import Compressor
from jaxcomm.compressors.staged import StagedCodec


@dataclass(frozen=True)
class ExactCodec(StagedCodec):
    """The exact mean as a staged codec: the fp32 values themselves, each chunk summed in
    device order (a reduce-scatter, then an all-gather).

    :class:`NoCompression` runs these stages where its exchanges leave the program (DiLoCo's
    background sync): the chunk sums are ``lax.psum``'s on XLA:CPU for two devices, within
    ``n - 1`` fp32 roundings of it for more.
    """

    error_feedback = False
    returns_mean = False
    lossy = False

    def chunk_layout(self, chunk_numel):
        return 1, chunk_numel

    def encode(self, blocks, divisor):
        return (blocks,), blocks

    def reduce(self, received, axis_size):
        total = received[0][0]
        for j in range(1, axis_size):
            total = total + received[0][j]
        return total

    def decode(self, wire):
        return wire[0]


@dataclass(frozen=True)
class NoCompression(Compressor):
    """Exact collectives in each leaf's own dtype, still fused into one collective per bucket.

    Equivalent to ``lax.psum`` / ``lax.pmean`` / ``lax.psum_scatter`` on every leaf, but a tree of
    300 small leaves costs one collective instead of 300 (DeepSpeed's coalesced operations).
    """

    lossy = False

    def compute_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)

    def staged_codec(self) -> ExactCodec:
        return ExactCodec()

    def all_reduce(self, flat, state, *, axis_name, axis_size):
        return lax.psum(flat, axis_name), state

    def reduce_scatter(self, rows, state, *, axis_name, axis_size):
        row = lax.psum_scatter(ensure_varying(rows, axis_name), axis_name, scatter_dimension=0)
        return row, state
