"""Compressors: how one bucket is reduced across a mesh axis.

A compressor turns a flat, fp32 (or native-dtype) bucket into a collective chain. It is a frozen
dataclass, so it is hashable and can be a static argument of ``jax.jit``; its per-bucket error
feedback is a ``NamedTuple`` of arrays, so it is jit-able, shardable and checkpointable.

Every compressor implements three reductions over an axis of size ``n``:

* ``all_reduce``: ``(N,)`` buffer -> ``(N,)`` sum or mean, identical on every device;
* ``reduce_scatter``: ``(n, C)`` rank-major buffer -> this device's ``(C,)`` row of the sum/mean;
* ``all_gather``: this device's ``(C,)`` row -> ``(n, C)``.

Integer and bool leaves never reach a compressor: they are reduced exactly by the caller.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying
from jaxcomm.bucketing import Bucket

# Bit k of a packed byte (most significant first) holds element 8*i + k: DeepSpeed's order.
_BIT_SHIFTS = np.arange(7, -1, -1, dtype=np.uint8)


class Compressor(abc.ABC):
    """Interface of a bucket compressor. Subclasses are frozen dataclasses."""

    #: True when reductions are lossy (MAX/MIN are then refused, since they cannot be compressed).
    lossy: bool = True

    def compute_dtype(self, dtype: np.dtype) -> np.dtype:
        """Dtype of the buffer a floating leaf of ``dtype`` is reduced in."""
        return np.dtype(np.float32)

    def init_all_reduce_state(self, numel: int, axis_size: int) -> Any:
        """Error-feedback state of one all-reduce bucket of ``numel`` elements (``()`` if none)."""
        return ()

    def init_reduce_scatter_state(self, row_numel: int, axis_size: int) -> Any:
        """Error-feedback state of one reduce-scatter bucket with rows of ``row_numel``."""
        return ()

    @abc.abstractmethod
    def all_reduce(
        self, flat: jax.Array, state: Any, *, axis_name: str, axis_size: int, mean: bool
    ) -> tuple[jax.Array, Any]:
        """Sum (or mean) of ``flat`` over the axis; returns it and the new bucket state."""

    @abc.abstractmethod
    def reduce_scatter(
        self, rows: jax.Array, state: Any, *, axis_name: str, axis_size: int, mean: bool
    ) -> tuple[jax.Array, Any]:
        """Row ``axis_index`` of the sum (or mean) of ``rows`` over the axis, and the new state."""

    def finite_probe(self, output: jax.Array, state: Any) -> list[jax.Array]:
        """Arrays that are all finite iff a bucket's ``output`` and new ``state`` are.

        The non-finite guard of :mod:`jaxcomm.collectives` checks these. The default is the
        output and every floating state leaf; a compressor whose non-finite values always
        spread through a scale (OneBit) returns a few elements instead.
        """
        leaves = jax.tree_util.tree_leaves(state)
        return [output, *(x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact))]

    def all_gather(self, row: jax.Array, *, axis_name: str, axis_size: int) -> jax.Array:
        """Every device's row, stacked ``(n, C)``. Exact unless a compressor overrides it."""
        return all_gather_replicated(row, axis_name)

    # Bucket-aware entry points, called by jaxcomm.collectives. By default they forward to the
    # flat methods above; a compressor that needs the leaves' shapes (PowerSGD views leaves as
    # matrices) overrides them. ``bucket`` is a static :class:`jaxcomm.bucketing.Bucket`.

    def init_bucket_state(self, bucket: Bucket, axis_size: int, op: str) -> Any:
        """State of one bucket for ``op`` (``"all_reduce"`` or ``"reduce_scatter"``)."""
        if op == "all_reduce":
            return self.init_all_reduce_state(bucket.numel, axis_size)
        return self.init_reduce_scatter_state(bucket.shard_numel(axis_size), axis_size)

    def all_reduce_bucket(
        self, flat: jax.Array, state: Any, bucket: Bucket, *, axis_name, axis_size, mean
    ) -> tuple[jax.Array, Any]:
        """:meth:`all_reduce` of a bucket's concatenated layout, knowing its leaves."""
        return self.all_reduce(flat, state, axis_name=axis_name, axis_size=axis_size, mean=mean)

    def reduce_scatter_bucket(
        self, rows: jax.Array, state: Any, bucket: Bucket, *, axis_name, axis_size, mean
    ) -> tuple[jax.Array, Any]:
        """:meth:`reduce_scatter` of a bucket's rank-major layout, knowing its leaves."""
        return self.reduce_scatter(rows, state, axis_name=axis_name, axis_size=axis_size, mean=mean)


@dataclass(frozen=True)
class NoCompression(Compressor):
    """Exact collectives in each leaf's own dtype, still fused into one collective per bucket.

    Equivalent to ``lax.psum`` / ``lax.pmean`` / ``lax.psum_scatter`` on every leaf, but a tree of
    300 small leaves costs one collective instead of 300 (DeepSpeed's coalesced operations).
    """

    lossy = False

    def compute_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)

    def all_reduce(self, flat, state, *, axis_name, axis_size, mean):
        out = lax.psum(flat, axis_name)
        return (out / axis_size if mean else out), state

    def reduce_scatter(self, rows, state, *, axis_name, axis_size, mean):
        row = lax.psum_scatter(ensure_varying(rows, axis_name), axis_name, scatter_dimension=0)
        return (row / axis_size if mean else row), state


class OneBitState(NamedTuple):
    """1-bit error feedback of one all-reduce bucket (fp32, private to its device).

    Attributes:
      worker_error: ``(Np,)`` residual of this device's compression of its input.
      server_error: ``(Np/n,)`` residual of this device's compression of its reduced chunk.
    """

    worker_error: jax.Array
    server_error: jax.Array


class OneBitScatterState(NamedTuple):
    """1-bit error feedback of one reduce-scatter bucket: the worker residual ``(n * C8,)``."""

    worker_error: jax.Array


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
            worker_error=jnp.zeros((axis_size * _round_up(row_numel, 8),), jnp.float32)
        )

    def _exchange(self, buf, worker_error, axis_name, axis_size):
        """Stages 1-2: compress ``buf + e_w``, all_to_all the signs; returns this chunk's mean."""
        packed, scale, worker_error = _scaled_sign_compress(buf + worker_error)
        packed = ensure_varying(packed.reshape(axis_size, -1), axis_name)
        received = lax.all_to_all(packed, axis_name, 0, 0, tiled=True)
        scales = lax.all_gather(ensure_varying(scale, axis_name), axis_name)
        return _weighted_sign_sum(received, scales / axis_size), worker_error

    def all_reduce(self, flat, state: OneBitState, *, axis_name, axis_size, mean):
        numel = flat.shape[0]
        padded = state.worker_error.shape[0]
        buf = jnp.pad(flat, (0, padded - numel))
        compensated, worker_error = self._exchange(buf, state.worker_error, axis_name, axis_size)
        packed, scale, server_error = _scaled_sign_compress(compensated + state.server_error)
        signs = all_gather_replicated(packed, axis_name)
        scales = all_gather_replicated(scale, axis_name)
        out = (unpack_signs(signs) * scales[:, None]).reshape(-1)[:numel]
        if not mean:
            out = out * axis_size
        return out, OneBitState(worker_error, server_error)

    def reduce_scatter(self, rows, state: OneBitScatterState, *, axis_name, axis_size, mean):
        row_numel = rows.shape[1]
        padded_row = state.worker_error.shape[0] // axis_size
        buf = jnp.pad(rows, ((0, 0), (0, padded_row - row_numel))).reshape(-1)
        row, worker_error = self._exchange(buf, state.worker_error, axis_name, axis_size)
        row = row[:row_numel]
        if not mean:
            row = row * axis_size
        return row, OneBitScatterState(worker_error)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded_length(numel: int, axis_size: int) -> int:
    """DeepSpeed pads the flat buffer to a multiple of ``8 n``: whole bytes in every chunk."""
    return _round_up(numel, 8 * axis_size)


# --------------------------------------------------------------------------------------------
# Compressors reduced in fp32 between an all_to_all and an all_gather (Quantize, Cast).
# --------------------------------------------------------------------------------------------


class TwoStageState(NamedTuple):
    """Error feedback of one all-reduce bucket of :class:`Quantize` / :class:`Cast` (fp32).

    Attributes:
      worker_error: ``(n * c,)`` residual of this device's compression of its padded input.
      server_error: ``(c,)`` residual of this device's recompression of its reduced chunk.
    """

    worker_error: jax.Array
    server_error: jax.Array


class TwoStageScatterState(NamedTuple):
    """Error feedback of one reduce-scatter bucket of :class:`Quantize` / :class:`Cast`."""

    worker_error: jax.Array


#: Names kept for readability at call sites.
QuantizeState = TwoStageState
QuantizeScatterState = TwoStageScatterState


class _ReduceInFp32(Compressor):
    """Skeleton of ``compress -> all_to_all -> decompress and reduce in fp32 -> recompress ->
    all_gather`` (ByteGrad, torchft, ZeRO++ qgZ): compressed values are never summed on the wire.

    A bucket of ``N`` elements is zero-padded to ``n * B * L`` (``n`` chunks of ``B`` blocks of
    ``L``); subclasses define the block layout and the codec:

    * ``_layout(chunk_numel) -> (B, L)``;
    * ``_encode(blocks, divisor) -> (wire, reconstruction)``: ``wire`` is a tuple of arrays with
      the leading dims of ``blocks``; ``reconstruction`` is what the receivers will decode, in the
      units of ``blocks`` (``divisor`` is ``n`` at the worker stage, for codecs that pre-divide);
    * ``_decode(wire)``: the ``(..., B, L)`` fp32 values the wire stands for;
    * ``_reduce_mean(wire, n)``: the mean over the leading (source device) axis of worker wires.
    """

    error_feedback: bool

    # -- hooks ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def _layout(self, chunk_numel: int) -> tuple[int, int]: ...

    @abc.abstractmethod
    def _encode(
        self, blocks: jax.Array, divisor: int
    ) -> tuple[tuple[jax.Array, ...], jax.Array]: ...

    @abc.abstractmethod
    def _decode(self, wire: tuple[jax.Array, ...]) -> jax.Array: ...

    @abc.abstractmethod
    def _reduce_mean(self, wire: tuple[jax.Array, ...], axis_size: int) -> jax.Array: ...

    # -- state ---------------------------------------------------------------------------------

    def init_all_reduce_state(self, numel: int, axis_size: int) -> TwoStageState | tuple:
        if not self.error_feedback:
            return ()
        blocks, length = self._layout(-(-numel // axis_size))
        chunk = blocks * length
        return TwoStageState(
            worker_error=jnp.zeros((axis_size * chunk,), jnp.float32),
            server_error=jnp.zeros((chunk,), jnp.float32),
        )

    def init_reduce_scatter_state(self, row_numel: int, axis_size: int):
        if not self.error_feedback:
            return ()
        blocks, length = self._layout(row_numel)
        return TwoStageScatterState(jnp.zeros((axis_size * blocks * length,), jnp.float32))

    # -- collectives ---------------------------------------------------------------------------

    def _exchange(self, buf, worker_error, axis_name, axis_size, blocks, length):
        """Worker stage, all_to_all and fp32 reduction: this device's chunk of the mean."""
        if worker_error is not None:
            buf = buf + worker_error
        wire, recon = self._encode(buf.reshape(axis_size, blocks, length), axis_size)
        if worker_error is not None:
            worker_error = buf - recon.reshape(-1)
        wire = tuple(
            lax.all_to_all(ensure_varying(w, axis_name), axis_name, 0, 0, tiled=True) for w in wire
        )
        return self._reduce_mean(wire, axis_size), worker_error

    def all_reduce(self, flat, state, *, axis_name, axis_size, mean):
        numel = flat.shape[0]
        blocks, length = self._layout(-(-numel // axis_size))
        buf = jnp.pad(flat, (0, axis_size * blocks * length - numel))
        ef = self.error_feedback
        chunk, worker_error = self._exchange(
            buf, state.worker_error if ef else None, axis_name, axis_size, blocks, length
        )
        if ef:
            chunk = chunk + state.server_error.reshape(blocks, length)
        wire, recon = self._encode(chunk, 1)
        new_state = TwoStageState(worker_error, (chunk - recon).reshape(-1)) if ef else state
        wire = tuple(all_gather_replicated(w, axis_name) for w in wire)
        out = self._decode(wire).reshape(-1)[:numel]
        return (out if mean else out * axis_size), new_state

    def reduce_scatter(self, rows, state, *, axis_name, axis_size, mean):
        row_numel = rows.shape[1]
        blocks, length = self._layout(row_numel)
        buf = jnp.pad(rows, ((0, 0), (0, blocks * length - row_numel))).reshape(-1)
        ef = self.error_feedback
        chunk, worker_error = self._exchange(
            buf, state.worker_error if ef else None, axis_name, axis_size, blocks, length
        )
        row = chunk.reshape(-1)[:row_numel]
        new_state = TwoStageScatterState(worker_error) if ef else state
        return (row if mean else row * axis_size), new_state

    def all_gather(self, row, *, axis_name, axis_size):
        """Each device's row is compressed, gathered and decompressed (lossy, no feedback)."""
        row_numel = row.shape[0]
        blocks, length = self._layout(row_numel)
        buf = jnp.pad(row.astype(jnp.float32), (0, blocks * length - row_numel))
        wire, _ = self._encode(buf.reshape(blocks, length), 1)
        wire = tuple(all_gather_replicated(ensure_varying(w, axis_name), axis_name) for w in wire)
        out = self._decode(wire).reshape(axis_size, -1)[:, :row_numel]
        return out.astype(row.dtype)


def _unrolled_sum(decode, wire: tuple[jax.Array, ...], axis_size: int) -> jax.Array:
    """``sum_j decode(wire[j])`` over the leading axis.

    Unrolled for small ``n``: one fused pass reads each received row once and no ``(n, ...)``
    fp32 buffer is materialized (memory bandwidth is the limit on CPU).
    """
    if axis_size <= 16:
        total = decode(tuple(w[0] for w in wire))
        for j in range(1, axis_size):
            total = total + decode(tuple(w[j] for w in wire))
        return total
    return jnp.sum(decode(wire), axis=0)


# --------------------------------------------------------------------------------------------
# Blockwise int8 / int4 quantization (ZeRO++ qgZ / qwZ).
# --------------------------------------------------------------------------------------------


def block_layout(chunk_numel: int, block_size: int, bits: int) -> tuple[int, int]:
    """``(B, L)``: a chunk of ``chunk_numel`` elements is cut into ``B`` blocks of length ``L``.

    ``B = ceil(chunk_numel / block_size)`` (at least 1) and ``L = ceil(chunk_numel / B)``, rounded
    up to even for int4 (two values per byte), so a chunk is padded by less than ``B + 1``
    elements instead of up to a whole block: small buckets stay small on the wire.
    """
    blocks = max(1, -(-chunk_numel // block_size))
    length = max(1, -(-chunk_numel // blocks))
    if bits == 4:
        length = _round_up(length, 2)
    return blocks, length


def quantize_blocks(values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantization of the last axis (one block per row).

    ``scale = 2^b / (2 absmax)`` (1 when ``absmax == 0``),
    ``q = clamp(round_half_even(x * scale), -2^(b-1), 2^(b-1) - 1)``; returns ``q`` (int8) and
    the stored value ``1 / scale`` (fp32, one per block); ``x ~ q / scale``.
    """
    absmax = jnp.max(jnp.abs(values), axis=-1)
    scale = jnp.where(absmax == 0, 1.0, (2.0**bits) / (2.0 * absmax)).astype(jnp.float32)
    half = 2 ** (bits - 1)
    # jnp.round rounds half to even, as ZeRO++'s quantizer.
    q = jnp.clip(jnp.round(values * scale[..., None]), -half, half - 1).astype(jnp.int8)
    return q, 1.0 / scale


def pack_int4(q: jax.Array) -> jax.Array:
    """Two int4 values per byte: element ``2i`` in the low nibble, ``2i+1`` in the high one."""
    pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2).astype(jnp.uint8)
    return (pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_int4` as int8 (sign-extended by arithmetic shifts); last axis 2x."""
    signed = lax.bitcast_convert_type(packed, jnp.int8)
    low = (signed << 4) >> 4
    high = signed >> 4
    both = jnp.stack([low, high], axis=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@dataclass(frozen=True)
class Quantize(_ReduceInFp32):
    """Blockwise symmetric int8/int4 quantization, reduced in fp32 (ZeRO++ qgZ, qwZ).

    Quantizer (Wang et al., *ZeRO++*, 2023): per block of at most ``block_size`` elements,
    ``scale = 2^b / (2 absmax)`` (1 if the block is all zero),
    ``q = clamp(round_half_even(x * scale), -2^(b-1), 2^(b-1) - 1)``; the block's ``1 / scale`` is
    sent along (fp32) and ``deq(q) = q / scale``. int4 values are packed two per byte.

    All-reduce of a bucket of ``N`` elements on device ``r`` of ``n`` (the pattern of ZeRO++'s
    qgZ, torchft and ByteGrad: integers are never summed on the wire):

    1. Pad to ``n * c`` (``c = B * L``, see :func:`block_layout`); ``buf = x + e_w``;
       quantize every block; ``e_w <- buf - deq(q(buf))``.
    2. all_to_all: device ``r`` receives chunk ``r`` of every device (codes and scales).
    3. ``m = sum_j q_j * (inv_j / n) + e_s`` in fp32; requantize ``m``; ``e_s <- m - deq(q(m))``.
    4. all_gather of the requantized chunks and scales; the mean is their dequantization cut to
       ``N`` (the sum is ``n`` times it).

    Bytes per device: ``2 (n-1)/n * (n c * b/8 + 4 n B)`` against ``2 (n-1)/n * 4 N`` for the fp32
    ring all-reduce: ``32 / (b + 32 / L)``, i.e. 3.99x (int8) and 7.97x (int4) for ``L = 2048``.

    With ``error_feedback=True`` both residuals are kept, as LoCo does (Xie et al., 2024, with
    its averaging coefficient ``beta = 0``): ``input + e_old == deq + e_new`` at both stages.
    Otherwise the state is empty.

    Reduce-scatter runs stages 1-3 without requantizing (the device keeps its fp32 chunk; only a
    worker residual). All-gather is qwZ: each device quantizes its row blockwise, codes and
    scales are all-gathered and dequantized (no error feedback: weights are not accumulated).

    Attributes:
      bits: 8 or 4.
      block_size: the most elements per block sharing one scale (ZeRO++ uses 2k-8k).
      error_feedback: keep worker and server residuals.
    """

    bits: int = 8
    block_size: int = 2048
    error_feedback: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"jaxcomm: Quantize bits must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.block_size, int | np.integer) or self.block_size < 2:
            raise ValueError(
                f"jaxcomm: Quantize block_size must be an int >= 2, got {self.block_size!r}"
            )

    def _layout(self, chunk_numel):
        return block_layout(chunk_numel, self.block_size, self.bits)

    def _encode(self, blocks, divisor):
        del divisor  # absmax scaling is scale-invariant: nothing to guard
        q, inv = quantize_blocks(blocks, self.bits)
        recon = q.astype(jnp.float32) * inv[..., None]
        return ((pack_int4(q) if self.bits == 4 else q), inv), recon

    def _decode(self, wire):
        codes, inv = wire
        q = unpack_int4(codes) if self.bits == 4 else codes
        return q.astype(jnp.float32) * inv[..., None]

    def _reduce_mean(self, wire, axis_size):
        codes, inv = wire
        return _unrolled_sum(self._decode, (codes, inv / axis_size), axis_size)


# --------------------------------------------------------------------------------------------
# bf16 / fp16 cast.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cast(_ReduceInFp32):
    """16-bit payload, fp32 reduction (torch's ``fp16_compress_hook`` / ``bf16_compress_hook``).

    Worker stage: ``c_j = cast(x_j / n)`` (pre-divided by ``n``, as torch's fp16 hook does, so
    ``n`` values near the fp16 maximum do not overflow); all_to_all; device ``r`` sums its chunk
    in fp32: ``m = sum_j float(c_j)`` (the mean); ``cast(m)`` is all-gathered and widened.
    The sum is ``n`` times the mean, computed in fp32 after the gather.

    Why not ``psum`` of the 16-bit buffer: XLA's CPU pipeline promotes a bf16 all-reduce to f32
    (measured on jax 0.10.2: ``all-reduce`` of ``f32`` with a ``_promoted`` reduction), which
    silently doubles the bytes, and a 16-bit ring sums partial results in 16 bits at every hop.
    all_to_all and all_gather only move data, and the payload crosses them as raw ``uint16``
    bits: XLA also moves plain float converts across them (measured: with a ``bf16`` operand the
    compiled all_to_all/all_gather ran in f32), but not a bitcast. The compiled HLO's payload is
    ``u16`` (tested) and the reduction is fp32. Bytes: ``2 (n-1)/n * 2 N``, 2x less than fp32.

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

    def _layout(self, chunk_numel):
        return 1, chunk_numel

    def _encode(self, blocks, divisor):
        scaled = blocks / divisor if divisor != 1 else blocks
        payload = scaled.astype(self.dtype)
        recon = payload.astype(jnp.float32)
        # Sent as raw uint16 bits: XLA's algebraic passes move a float convert across an
        # all_to_all/all_gather (measured: the bf16 payload became f32 on CPU), not a bitcast.
        bits = lax.bitcast_convert_type(payload, jnp.uint16)
        return (bits,), (recon * divisor if divisor != 1 else recon)

    def _decode(self, wire):
        return lax.bitcast_convert_type(wire[0], self.dtype).astype(jnp.float32)

    def _reduce_mean(self, wire, axis_size):
        return _unrolled_sum(self._decode, wire, axis_size)


# --------------------------------------------------------------------------------------------
# PowerSGD (Vogels et al., 2019; torch's powerSGD_hook).
# --------------------------------------------------------------------------------------------


class PowerSGDState(NamedTuple):
    """PowerSGD state of one bucket (private to its device, identical ``q`` on every device).

    Attributes:
      error: ``(N,)`` fp32: local compensated input minus the decompressed mean (all zeros when
        ``error_feedback=False``).
      q: ``(sum_i m_i r_i,)`` fp32 (at least 1): each compressed leaf's last all-reduced ``Q``
        (``m_i x r_i``), reused by warm start.
      step: ``(1,)`` int32: calls so far; without warm start ``Q`` is drawn anew from it.
    """

    error: jax.Array
    q: jax.Array
    step: jax.Array


@dataclass(frozen=True)
class _PowerSGDLeaf:
    offset: int  # in the bucket's concatenated layout
    size: int
    rows: int
    cols: int
    rank: int  # 0: sent exactly


def _gram_schmidt(matrix: jax.Array, epsilon: float) -> jax.Array:
    """Orthonormal columns, left to right (torch's ``_orthogonalize_gram_schmidt``).

    A zero column stays zero (torch divides by ``norm + epsilon``; with ``epsilon = 0`` a zero
    column would become NaN).
    """
    cols = []
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        for prev in cols:
            col = col - jnp.dot(prev, col) * prev
        norm = jnp.sqrt(jnp.sum(jnp.square(col)))
        denom = norm + epsilon
        cols.append(jnp.where(denom > 0, col / jnp.where(denom > 0, denom, 1.0), 0.0))
    return jnp.stack(cols, axis=1)


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``r`` PowerSGD all-reduce with error feedback (Vogels et al., *PowerSGD*, 2019).

    torch's ``powerSGD_hook`` per bucket, on ``n`` devices:

    1. ``c = x + e`` (the compensated input). Each leaf is viewed as a matrix
       ``M (shape[0], prod(shape[1:]))`` with ``r = min(rows, cols, rank)``; it is compressed
       only if it has 2+ dims and ``(rows + cols) r * min_compression_rate < rows cols``; all
       other leaves travel exactly, fused into the ``P`` all-reduce.
    2. ``Q`` (``cols x r``): the previous step's (``warm_start``) or drawn from a key shared by
       all devices (``normal(fold_in(fold_in(PRNGKey(seed), step), leaf))``); orthogonalized.
    3. ``P = M Q``; all-reduce ``P`` (and the exact leaves); orthogonalize ``P`` (Gram-Schmidt).
    4. ``Q = M^T P``; all-reduce ``Q``.
    5. ``mean ~ P Q^T / n``; ``e = c - mean`` over the whole bucket (exact leaves included,
       as torch's hook); the sum is ``n`` times the mean.

    Bytes per device: ``2 (n-1)/n * 4 (sum_i (rows_i + cols_i) r_i + exact numel)``, against
    ``2 (n-1)/n * 4 N`` for fp32 (2 all-reduces instead of 1, more latency).

    Differences from torch: Gram-Schmidt for every rank (torch uses QR above rank 2; the product
    ``P Q^T`` does not depend on which, up to rounding), a zero column stays zero instead of
    becoming NaN, there is no ``start_powerSGD_iter`` warm-up (call ``NoCompression`` for the
    first steps) and the state is an explicit pytree. Reduce-scatter runs the all-reduce and
    keeps this device's rows (same bytes); all-gather is exact.

    Attributes:
      rank: the approximation rank ``r`` (torch's ``matrix_approximation_rank``).
      min_compression_rate: compress a leaf only if it shrinks by more than this.
      warm_start: reuse the last ``Q`` instead of drawing a new one.
      error_feedback: keep the residual ``e``.
      seed: seed of the shared random ``Q``.
      orthogonalization_epsilon: added to column norms.
    """

    rank: int = 1
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0
    orthogonalization_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.rank, int | np.integer) or self.rank < 1:
            raise ValueError(f"jaxcomm: PowerSGD rank must be an int >= 1, got {self.rank!r}")
        if not self.min_compression_rate >= 1:
            raise ValueError(
                "jaxcomm: PowerSGD min_compression_rate must be >= 1, got "
                f"{self.min_compression_rate!r}"
            )

    def leaf_plan(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[_PowerSGDLeaf, ...]:
        """Which leaves of a bucket are compressed, as which matrices, at which rank."""
        plan, offset = [], 0
        for shape in shapes:
            size = math.prod(shape)
            rows = shape[0] if shape else 1
            cols = size // rows if rows else 0
            r = min(rows, cols, self.rank)
            compress = len(shape) >= 2 and (rows + cols) * r * self.min_compression_rate < size
            plan.append(_PowerSGDLeaf(offset, size, rows, cols, r if compress else 0))
            offset += size
        return tuple(plan)

    def _initial_qs(self, plan, key) -> list[jax.Array]:
        return [
            jax.random.normal(jax.random.fold_in(key, i), (leaf.cols, leaf.rank), jnp.float32)
            for i, leaf in enumerate(plan)
            if leaf.rank
        ]

    def init_bucket_state(self, bucket: Bucket, axis_size: int, op: str) -> PowerSGDState:
        plan = self.leaf_plan(bucket.shapes)
        qs = self._initial_qs(plan, jax.random.fold_in(jax.random.PRNGKey(self.seed), 0))
        q = jnp.concatenate([q.reshape(-1) for q in qs]) if qs else jnp.zeros((1,), jnp.float32)
        return PowerSGDState(
            error=jnp.zeros((bucket.numel,), jnp.float32), q=q, step=jnp.zeros((1,), jnp.int32)
        )

    def all_reduce(self, flat, state, *, axis_name, axis_size, mean):
        raise TypeError(
            "jaxcomm: PowerSGD needs the leaves' shapes; call it through jc.compressed_psum / "
            "compressed_pmean / compressed_psum_scatter"
        )

    reduce_scatter = all_reduce

    def all_reduce_bucket(self, flat, state: PowerSGDState, bucket, *, axis_name, axis_size, mean):
        plan = self.leaf_plan(bucket.shapes)
        low = [leaf for leaf in plan if leaf.rank]
        exact = [leaf for leaf in plan if not leaf.rank]
        comp = flat + state.error if self.error_feedback else flat
        eps = self.orthogonalization_epsilon

        if self.warm_start:
            qs, offset = [], 0
            for leaf in low:
                n_q = leaf.cols * leaf.rank
                qs.append(state.q[offset : offset + n_q].reshape(leaf.cols, leaf.rank))
                offset += n_q
        else:
            key = jax.random.fold_in(jax.random.PRNGKey(self.seed), state.step[0])
            qs = self._initial_qs(plan, key)
        qs = [_gram_schmidt(q, eps) for q in qs]
        ms = [comp[lf.offset : lf.offset + lf.size].reshape(lf.rows, lf.cols) for lf in low]

        # One all-reduce for every P and the exact leaves; one for every Q.
        parts = [(m @ q).reshape(-1) for m, q in zip(ms, qs, strict=True)]
        parts += [comp[lf.offset : lf.offset + lf.size] for lf in exact]
        summed = lax.psum(jnp.concatenate(parts), axis_name)
        ps, offset = [], 0
        for leaf in low:
            n_p = leaf.rows * leaf.rank
            ps.append(_gram_schmidt(summed[offset : offset + n_p].reshape(leaf.rows, -1), eps))
            offset += n_p
        exact_mean = summed[offset:] / axis_size
        q_new = state.q
        if low:
            q_new = lax.psum(
                jnp.concatenate([(m.T @ p).reshape(-1) for m, p in zip(ms, ps, strict=True)]),
                axis_name,
            )

        # Reassemble the mean in leaf order.
        pieces, q_off, e_off, li = [], 0, 0, 0
        for leaf in plan:
            if leaf.rank:
                n_q = leaf.cols * leaf.rank
                q = q_new[q_off : q_off + n_q].reshape(leaf.cols, leaf.rank)
                pieces.append((ps[li] @ q.T).reshape(-1) / axis_size)
                q_off += n_q
                li += 1
            else:
                pieces.append(exact_mean[e_off : e_off + leaf.size])
                e_off += leaf.size
        out = jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        new_state = PowerSGDState(
            error=comp - out if self.error_feedback else state.error,
            q=q_new if self.warm_start else state.q,
            step=state.step + 1,
        )
        return (out if mean else out * axis_size), new_state

    def reduce_scatter_bucket(self, rows, state, bucket, *, axis_name, axis_size, mean):
        """The low-rank all-reduce of the whole bucket, then this device's rank-major row."""
        offsets = np.cumsum((0,) + bucket.shard_sizes(axis_size))
        flat = jnp.concatenate(
            [
                rows[:, offsets[k] : offsets[k] + c].reshape(-1)[:size]
                for k, (size, c) in enumerate(
                    zip(bucket.sizes, bucket.shard_sizes(axis_size), strict=True)
                )
            ]
        )
        reduced, state = self.all_reduce_bucket(
            flat, state, bucket, axis_name=axis_name, axis_size=axis_size, mean=mean
        )
        layout, start = [], 0
        for size, c in zip(bucket.sizes, bucket.shard_sizes(axis_size), strict=True):
            leaf = jnp.pad(reduced[start : start + size], (0, axis_size * c - size))
            layout.append(leaf.reshape(axis_size, c))
            start += size
        full = jnp.concatenate(layout, axis=1)
        index = lax.axis_index(axis_name)
        return lax.dynamic_index_in_dim(full, index, axis=0, keepdims=False), state


# --------------------------------------------------------------------------------------------
# Top-k sparsification.
# --------------------------------------------------------------------------------------------


class TopKState(NamedTuple):
    """Error feedback of one :class:`TopK` bucket: the unsent residual, ``(N,)`` or ``(n C,)``."""

    error: jax.Array


def _top_k_by_magnitude(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` entries of largest ``|v|`` along the last axis: ``(values, int32 indices)``."""
    _, idx = lax.top_k(jnp.abs(values), k)
    return jnp.take_along_axis(values, idx, axis=-1), idx.astype(jnp.int32)


@dataclass(frozen=True)
class TopK(Compressor):
    """Top-k sparsification by magnitude with error feedback (Stich et al., 2018; Lin et al.,
    *Deep Gradient Compression*, 2018).

    All-reduce of a bucket of ``N`` elements: ``buf = x + e``; keep the ``k = ceil(f N)`` entries
    of largest ``|buf|``; ``e <- buf`` with those entries zeroed; all_gather every device's
    ``(value fp32, index int32)`` pairs; the sum is the scatter-add of all ``n k`` pairs (the
    mean is it over ``n``), identical on every device.

    Reduce-scatter: top ``k = ceil(f C)`` of each destination row, all_to_all of the pairs, and
    device ``r`` scatter-adds what it received into its ``(C,)`` row. All-gather is exact.

    Cost model, bytes per device (ring model of :mod:`jaxcomm.hlo`), against the fp32 ring
    all-reduce ``2 (n-1)/n * 4N``:

    * all-reduce: ``(n-1)/n * n k * 8 = 8 (n-1) f N``; ratio ``1 / (n f)``. The gathered
      volume grows with ``n`` (sparse sums do not stay sparse), so top-k beats dense int8
      (about 4x) only when ``f < 1 / (4 n)``: below 3% at ``n = 8``, 0.4% at ``n = 64``. It
      also pays a top-k selection and a scatter of ``n k`` pairs.
    * reduce-scatter: ``(n-1)/n * n k_row * 8`` against ``(n-1)/n * 4 n C``: ratio
      ``1 / (2 f)`` at any ``n``; it beats dense int8 for ``f < 1/8``.

    Attributes:
      fraction: ``f``, the share of entries sent (``0 < f <= 1``).
      error_feedback: keep the unsent residual (without it top-k is badly biased).
    """

    fraction: float = 0.01
    error_feedback: bool = True

    def __post_init__(self):
        if not 0 < self.fraction <= 1:
            raise ValueError(f"jaxcomm: TopK fraction must be in (0, 1], got {self.fraction!r}")

    def _k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.fraction * numel)))

    def init_all_reduce_state(self, numel, axis_size):
        return TopKState(jnp.zeros((numel,), jnp.float32)) if self.error_feedback else ()

    def init_reduce_scatter_state(self, row_numel, axis_size):
        if not self.error_feedback:
            return ()
        return TopKState(jnp.zeros((axis_size * row_numel,), jnp.float32))

    def _select(self, buf: jax.Array, k: int, state):
        """Top-k of each row of ``buf``; the new residual (``buf`` minus what is sent)."""
        if self.error_feedback:
            buf = buf + state.error.reshape(buf.shape)
        values, idx = _top_k_by_magnitude(buf, k)
        new_state = state
        if self.error_feedback:
            sent = jnp.put_along_axis(buf, idx, 0.0, axis=-1, inplace=False)
            new_state = TopKState(sent.reshape(-1))
        return values, idx, new_state

    def all_reduce(self, flat, state, *, axis_name, axis_size, mean):
        numel = flat.shape[0]
        values, idx, new_state = self._select(flat, self._k(numel), state)
        values = all_gather_replicated(ensure_varying(values, axis_name), axis_name)
        idx = all_gather_replicated(ensure_varying(idx, axis_name), axis_name)
        out = jnp.zeros((numel,), jnp.float32).at[idx.reshape(-1)].add(values.reshape(-1))
        return (out / axis_size if mean else out), new_state

    def reduce_scatter(self, rows, state, *, axis_name, axis_size, mean):
        row_numel = rows.shape[1]
        values, idx, new_state = self._select(rows, self._k(row_numel), state)
        values = lax.all_to_all(ensure_varying(values, axis_name), axis_name, 0, 0, tiled=True)
        idx = lax.all_to_all(ensure_varying(idx, axis_name), axis_name, 0, 0, tiled=True)
        row = jnp.zeros((row_numel,), jnp.float32).at[idx.reshape(-1)].add(values.reshape(-1))
        return (row / axis_size if mean else row), new_state
