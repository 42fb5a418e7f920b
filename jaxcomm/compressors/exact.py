"""The exact mean: :class:`NoCompression`, and its stages (:class:`ExactCodec`)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.compressors._base import Compressor
from jaxcomm.compressors.buckets import split_concatenated
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
    """Exact collectives in each leaf's own dtype, still fused into one collective per bucket
    (on GPU and TPU one all-reduce of the bucket's leaves where they lie, as XLA's combiner
    groups them: :func:`psum_pieces`).

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

    def all_reduce_bucket(self, flat, state, bucket, *, axis_name, axis_size):
        """One all-reduce of the bucket: of its concatenation on XLA:CPU, of its leaves'
        pieces elsewhere (:func:`psum_pieces`)."""
        if len(bucket.sizes) <= 1:
            return self.all_reduce(flat, state, axis_name=axis_name, axis_size=axis_size)

        def whole(flat):
            return lax.psum(flat, axis_name)

        def pieces(flat):
            return psum_pieces(flat, bucket, axis_name)

        return lax.platform_dependent(flat, cpu=whole, default=pieces), state

    def reduce_scatter(self, rows, state, *, axis_name, axis_size):
        row = lax.psum_scatter(ensure_varying(rows, axis_name), axis_name, scatter_dimension=0)
        return row, state


def psum_pieces(flat, bucket, axis_name):
    """``lax.psum`` of a bucket's concatenation, summed piece by piece (one per leaf, one
    variadic all-reduce after XLA's combiner).

    The concatenation around it folds away (each piece is its leaf), so XLA:GPU and XLA:TPU
    reduce every leaf where it lies: no copy of the bucket into one buffer and back, a pass
    over every gradient that the exact mean would otherwise add to a step. The sums are the
    same elementwise sums.
    """
    return jnp.concatenate(lax.psum(split_concatenated(flat, bucket), axis_name))
