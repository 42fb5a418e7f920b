"""1-bit compression with two-stage error feedback (DeepSpeed's compressed all-reduce)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying
from jaxcomm.compressors._base import Compressor
from jaxcomm.compressors._two_stage import TwoStageScatterState, TwoStageState
from jaxcomm.layout import round_up

# Bit k of a packed byte (most significant first) holds element 8*i + k: DeepSpeed's order.
_BIT_SHIFTS = np.arange(7, -1, -1, dtype=np.uint8)

#: OneBit's states are the two-stage states (the same fields); the names stay for readability.
OneBitState = TwoStageState
OneBitScatterState = TwoStageScatterState


def pack_signs(values: jax.Array) -> jax.Array:
    """Pack ``values >= 0`` 8 per byte, most significant bit first. ``len(values) % 8 == 0``."""
    bits = (values >= 0).astype(jnp.uint8).reshape(-1, 8)
    return jnp.sum(bits << _BIT_SHIFTS, axis=-1, dtype=jnp.uint8)


def unpack_signs(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_signs` as ``+1.0 / -1.0`` floats; the last axis grows 8x."""
    bits = (packed[..., None] >> _BIT_SHIFTS) & 1
    signs = bits.astype(jnp.float32) * 2.0 - 1.0
    return signs.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def _sign(values: jax.Array) -> jax.Array:
    # sgn(0) = +1, as DeepSpeed's packing does: the reconstruction must use the packed bit.
    return jnp.where(values >= 0, 1.0, -1.0).astype(values.dtype)


def _scaled_sign_compress(buf: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``s = ||buf|| / sqrt(len)``; returns packed signs, ``s`` and ``buf - s * sgn(buf)``."""
    scale = jnp.sqrt(jnp.sum(jnp.square(buf))) / math.sqrt(buf.shape[0])
    return pack_signs(buf), scale, buf - scale * _sign(buf)


def _weighted_sign_sum(packed: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum_j weights[j] * unpack(packed[j])`` for packed ``(n, M)`` -> ``(8M,)`` fp32.

    For small ``n`` this unrolls into one elementwise fusion that reads each packed row once and
    never materializes ``n`` unpacked float rows (the naive broadcast is ~4x slower on CPU).
    """
    n = packed.shape[0]
    if n <= 16:
        total = weights[0] * unpack_signs(packed[0])
        for j in range(1, n):
            total = total + weights[j] * unpack_signs(packed[j])
        return total
    return jnp.einsum("j,jm->m", weights, unpack_signs(packed))


def _padded_length(numel: int, axis_size: int) -> int:
    """DeepSpeed pads the flat buffer to a multiple of ``8 n``: whole bytes in every chunk."""
    return round_up(numel, 8 * axis_size)


@dataclass(frozen=True)
class OneBit(Compressor):
    """DeepSpeed's 1-bit compressed all-reduce with two-stage error feedback.

    For a bucket ``x`` of length ``N`` zero-padded to ``Np`` (a multiple of ``8n``), on device
    ``r`` of ``n`` (Tang et al., *1-bit Adam*, 2021; DeepSpeed ``runtime/comm/nccl.py``):

    1. ``buf = x + e_w``; ``s_w = ||buf||_2 / sqrt(Np)``; ``e_w <- buf - s_w * sgn(buf)``
       with ``sgn(v) = +1 if v >= 0 else -1``.
    2. Signs are packed 8 per byte; chunk ``j`` (``Np/n`` elements) goes to device ``j``
       (all_to_all) and the scales are all-gathered.
    3. ``c = sum_j (s_w[j] / n) * sgn_j[chunk r] + e_s``; ``s_s = ||c|| / sqrt(Np/n)``;
       ``e_s <- c - s_s * sgn(c)``.
    4. Server signs and scales are all-gathered; the mean is ``concat_r s_s[r] * sgn(c_r)``
       cut to ``N`` (the sum is ``n`` times it).

    Only packed ``uint8`` signs and ``n`` fp32 scales per stage cross the wire: about
    ``2 (n-1)/n * Np/8`` bytes per device against ``2 (n-1)/n * 4N`` for an fp32 ring all-reduce
    (32x less). Invariant at both stages: ``input + e_old == reconstruction + e_new``.

    Reduce-scatter uses stages 1-2 only (device ``r`` keeps the decompressed mean of its
    chunk, so there is no server residual). All-gather is exact: 1-bit weights would destroy
    them, and weights carry no error feedback.
    """

    returns_mean = True

    def finite_probe(self, output, state) -> list[jax.Array]:
        # A non-finite input makes a scale (an L2 norm) non-finite, and every element of a chunk
        # is scale * sign: one element per output chunk and the first element of each error
        # buffer decide finiteness exactly, without another pass over the buffers.
        probes = [x[:1] for x in state]
        if isinstance(state, OneBitState):
            step = state.server_error.shape[0]
            probes.append(output[::step])
        else:
            probes.append(output[:1])
        return probes

    def init_all_reduce_state(self, numel: int, axis_size: int) -> OneBitState:
        padded = _padded_length(numel, axis_size)
        return OneBitState(
            worker_error=jnp.zeros((padded,), jnp.float32),
            server_error=jnp.zeros((padded // axis_size,), jnp.float32),
        )

    def init_reduce_scatter_state(self, row_numel: int, axis_size: int) -> OneBitScatterState:
        return OneBitScatterState(
            worker_error=jnp.zeros((axis_size * round_up(row_numel, 8),), jnp.float32)
        )

    def _exchange(self, buf, worker_error, axis_name, axis_size):
        """Stages 1-2: compress ``buf + e_w``, all_to_all the signs; returns this chunk's mean."""
        packed, scale, worker_error = _scaled_sign_compress(buf + worker_error)
        packed = ensure_varying(packed.reshape(axis_size, -1), axis_name)
        received = lax.all_to_all(packed, axis_name, 0, 0, tiled=True)
        scales = lax.all_gather(ensure_varying(scale, axis_name), axis_name)
        return _weighted_sign_sum(received, scales / axis_size), worker_error

    def all_reduce(self, flat, state: OneBitState, *, axis_name, axis_size):
        numel = flat.shape[0]
        padded = state.worker_error.shape[0]
        buf = jnp.pad(flat, (0, padded - numel))
        compensated, worker_error = self._exchange(buf, state.worker_error, axis_name, axis_size)
        packed, scale, server_error = _scaled_sign_compress(compensated + state.server_error)
        signs = all_gather_replicated(packed, axis_name)
        scales = all_gather_replicated(scale, axis_name)
        out = (unpack_signs(signs) * scales[:, None]).reshape(-1)[:numel]
        return out, OneBitState(worker_error, server_error)

    def reduce_scatter(self, rows, state: OneBitScatterState, *, axis_name, axis_size):
        row_numel = rows.shape[1]
        padded_row = state.worker_error.shape[0] // axis_size
        buf = jnp.pad(rows, ((0, 0), (0, padded_row - row_numel))).reshape(-1)
        row, worker_error = self._exchange(buf, state.worker_error, axis_name, axis_size)
        return row[:row_numel], OneBitScatterState(worker_error)
