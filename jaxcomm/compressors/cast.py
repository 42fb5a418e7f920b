"""bf16 / fp16 payload with an fp32 reduction (torch's fp16/bf16 compress hooks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.compressors.staged import StagedCodec, unrolled_sum


@dataclass(frozen=True)
class Cast(StagedCodec):
    """16-bit payload, fp32 reduction (torch's ``fp16_compress_hook`` / ``bf16_compress_hook``).

    Worker stage: ``c_j = cast(x_j / n)`` (pre-divided by ``n``, as torch's fp16 hook does, so
    ``n`` values near the fp16 maximum do not overflow); all_to_all; device ``r`` sums its chunk
    in fp32: ``m = sum_j float(c_j)`` (the mean); ``cast(m)`` is all-gathered and widened.
    The sum is ``n`` times the mean, computed in fp32 after the gather.

    Why not ``psum`` of the 16-bit buffer: XLA's CPU pipeline promotes a bf16 all-reduce to f32
    (seen on jax 0.10.2: ``all-reduce`` of ``f32`` with a ``_promoted`` reduction), which
    silently doubles the bytes, and a 16-bit ring sums partial results in 16 bits at every hop.
    all_to_all and all_gather only move data, and the payload crosses them as raw ``uint16``
    bits: XLA also moves plain float converts across them (seen: with a ``bf16`` operand the
    compiled all_to_all/all_gather ran in f32), but not a bitcast. The compiled HLO's payload is
    ``u16`` (tested) and the reduction is fp32. Bytes: ``2 (n-1)/n * 2 N``, 2x fewer bytes than
    fp32.

    With ``error_feedback=True`` the rounding residuals of both casts are kept (in fp32), which
    removes the bias of the running average. Sums beyond the 16-bit range are fine (the wire
    carries ``x / n`` and the mean); a *mean* beyond it (fp16: 65504) becomes ``inf``.

    Attributes:
      dtype: ``jnp.bfloat16`` or ``jnp.float16``.
      error_feedback: keep worker and server residuals.
    """

    dtype: Any = jnp.bfloat16
    error_feedback: bool = False

    def __post_init__(self):
        if np.dtype(self.dtype) not in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
            raise ValueError(
                f"jaxcomm: Cast dtype must be jnp.bfloat16 or jnp.float16, got {self.dtype!r}"
            )

    def chunk_layout(self, chunk_numel):
        return 1, chunk_numel

    def encode(self, blocks, divisor):
        scaled = blocks / divisor if divisor != 1 else blocks
        payload = scaled.astype(self.dtype)
        recon = payload.astype(jnp.float32)
        # Sent as raw uint16 bits: XLA's algebraic passes move a float convert across an
        # all_to_all/all_gather (seen: the bf16 payload became f32 on CPU), not a bitcast.
        bits = lax.bitcast_convert_type(payload, jnp.uint16)
        return (bits,), (recon * divisor if divisor != 1 else recon)

    def decode(self, wire):
        return lax.bitcast_convert_type(wire[0], self.dtype).astype(jnp.float32)

    def reduce(self, received, axis_size):
        return unrolled_sum(self.decode, received, axis_size)
