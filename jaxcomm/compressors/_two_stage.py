"""Two-stage error feedback and the fp32-reduction skeleton of :class:`Quantize` / :class:`Cast`.

Two-stage compressors (OneBit, Quantize, Cast) compress at a worker stage (each device's input,
before the all_to_all) and at a server stage (each device's reduced chunk, before the
all_gather); each stage keeps its residual. :class:`TwoStageState` holds both residuals.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying
from jaxcomm.comm.buckets import ceil_div
from jaxcomm.compressors._base import (
    Compressor,
    probes_finite,
    rank_major_pending,
    rank_major_share,
)


class TwoStageState(NamedTuple):
    """Error feedback of one all-reduce bucket of OneBit, Quantize or Cast (fp32, per device).

    Attributes:
      worker_error: ``(n * c,)`` residual of this device's compression of its padded input.
      server_error: ``(c,)`` residual of this device's recompression of its reduced chunk
        (``c``: the padded chunk; OneBit pads the bucket to a multiple of ``8 n``).
    """

    worker_error: jax.Array
    server_error: jax.Array


class TwoStageScatterState(NamedTuple):
    """Error feedback of one reduce-scatter bucket of OneBit, Quantize or Cast: ``(n * c,)``."""

    worker_error: jax.Array


class TwoStageFeedback(Compressor):
    """A compressor whose bucket states are :class:`TwoStageState` (all-reduce) and
    :class:`TwoStageScatterState` (reduce-scatter): their host-side resize.

    All-reduce: ``T = sum_r w_r[:N] + n * S[:N]`` with ``S = concat_r server_error_r`` (server
    chunk ``r`` covers ``[r c, (r+1) c)``; the server residual is in the units of the mean). The
    residual in padding positions is not gradient information and is dropped. Reduce-scatter:
    the worker residuals' rank-major rows, mapped back to the bucket's coordinates.
    """

    def pending_sum(self, states: Sequence[Any], bucket, op: str) -> np.ndarray | None:
        if op != "all_reduce":
            return rank_major_pending([s.worker_error for s in states], bucket)
        numel = bucket.numel
        worker = sum(np.asarray(s.worker_error, np.float64)[:numel] for s in states)
        server = np.concatenate([np.asarray(s.server_error, np.float64) for s in states])
        return worker + len(states) * server[:numel]

    def with_pending(self, share, template, bucket, op, *, axis_size, old):
        if op != "all_reduce":
            length = template.worker_error.shape[0]
            return type(template)(rank_major_share(share, bucket, axis_size, length))
        worker = np.zeros(template.worker_error.shape, np.float32)
        worker[: bucket.numel] = share
        return type(template)(worker, np.zeros(template.server_error.shape, np.float32))


class ReduceInFp32(TwoStageFeedback):
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
    returns_mean = True
    # All-reduce state leaves arrive as the (1, *local) blocks shard_map hands them and go back
    # in that shape, so that XLA updates the donated residuals in place (see Compressor).
    _takes_state_blocks = True

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

    def _decoded_finite_probe(
        self, wire: tuple[jax.Array, ...], numel: int, length: int
    ) -> jax.Array | None:
        """Values that are all finite exactly when the first ``numel`` elements of
        ``_decode(wire)`` (flattened, blocks of ``length``) are, read without decoding; ``None``
        when the codec knows none (check the decoded values)."""
        del wire, numel, length
        return None

    # -- state ---------------------------------------------------------------------------------

    def init_all_reduce_state(self, numel: int, axis_size: int) -> TwoStageState | tuple:
        if not self.error_feedback:
            return ()
        blocks, length = self._layout(ceil_div(numel, axis_size))
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

    def all_reduce(self, flat, state, *, axis_name, axis_size):
        numel = flat.shape[0]
        blocks, length = self._layout(ceil_div(numel, axis_size))
        buf = jnp.pad(flat, (0, axis_size * blocks * length - numel))
        ef = self.error_feedback
        chunk, worker_error = self._exchange(
            buf, state.worker_error if ef else None, axis_name, axis_size, blocks, length
        )
        if ef:
            chunk = chunk + state.server_error.reshape(blocks, length)
        wire, recon = self._encode(chunk, 1)
        if ef:
            server_error = (chunk - recon).reshape(state.server_error.shape)
            new_state = TwoStageState(worker_error.reshape(state.worker_error.shape), server_error)
        else:
            new_state = state
        wire = tuple(all_gather_replicated(w, axis_name) for w in wire)
        out = self._decode(wire).reshape(-1)[:numel]
        return out, new_state

    def guarded_all_reduce_bucket(self, flat, state, bucket, *, axis_name, axis_size):
        """The guard decided from the block scales, before the residuals are written.

        A codec whose decoded values are all finite exactly when some of its wire's values are
        (``_decoded_finite_probe``: Quantize's block scales) gives the verdict without a pass
        over the output or the new residuals: this device's worker input is finite iff its
        worker scales are (so is its new worker residual), and every device's server chunk,
        hence the output and this device's new server residual, iff the gathered server scales
        are. The new residuals are then written once, ``where(finite, new, old)``, instead of
        written, probed, and selected against the old ones (about 9 passes over the worker
        residual down to 3). Same values and the same verdict as the default guard.
        """
        numel = flat.shape[0]
        blocks, length = self._layout(ceil_div(numel, axis_size))
        padded = axis_size * blocks * length
        buf = jnp.pad(flat, (0, padded - numel))
        if self.error_feedback:
            buf = buf + state.worker_error
        wire, recon = self._encode(buf.reshape(axis_size, blocks, length), axis_size)
        worker_probe = self._decoded_finite_probe(wire, padded, length)
        if not self.error_feedback or worker_probe is None:
            return super().guarded_all_reduce_bucket(
                flat, state, bucket, axis_name=axis_name, axis_size=axis_size
            )
        wire = tuple(
            lax.all_to_all(ensure_varying(w, axis_name), axis_name, 0, 0, tiled=True) for w in wire
        )
        chunk = self._reduce_mean(wire, axis_size) + state.server_error.reshape(blocks, length)
        server_wire, server_recon = self._encode(chunk, 1)
        gathered = tuple(all_gather_replicated(w, axis_name) for w in server_wire)
        server_probe = self._decoded_finite_probe(gathered, axis_size * blocks * length, length)
        finite = probes_finite([worker_probe, server_probe])
        worker_error, server_error = state.worker_error, state.server_error
        new_state = TwoStageState(
            jnp.where(finite, (buf - recon.reshape(-1)).reshape(worker_error.shape), worker_error),
            jnp.where(finite, (chunk - server_recon).reshape(server_error.shape), server_error),
        )
        return self._decode(gathered).reshape(-1)[:numel], new_state, finite

    def reduce_scatter(self, rows, state, *, axis_name, axis_size):
        row_numel = rows.shape[1]
        blocks, length = self._layout(row_numel)
        buf = jnp.pad(rows, ((0, 0), (0, blocks * length - row_numel))).reshape(-1)
        ef = self.error_feedback
        chunk, worker_error = self._exchange(
            buf, state.worker_error if ef else None, axis_name, axis_size, blocks, length
        )
        row = chunk.reshape(-1)[:row_numel]
        new_state = TwoStageScatterState(worker_error) if ef else state
        return row, new_state

    def all_gather(self, row, *, axis_name, axis_size):
        """Each device's row is compressed, gathered and decompressed (lossy, no feedback)."""
        row_numel = row.shape[0]
        blocks, length = self._layout(row_numel)
        buf = jnp.pad(row.astype(jnp.float32), (0, blocks * length - row_numel))
        wire, _ = self._encode(buf.reshape(blocks, length), 1)
        wire = tuple(all_gather_replicated(ensure_varying(w, axis_name), axis_name) for w in wire)
        out = self._decode(wire).reshape(axis_size, -1)[:, :row_numel]
        return out.astype(row.dtype)


def unrolled_sum(decode, wire: tuple[jax.Array, ...], axis_size: int) -> jax.Array:
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
