"""Staged codecs: a compressed mean as three stages around two exchanges, over any transport.

A staged codec (:class:`StagedCodec`: :class:`jaxcomm.OneBit`, :class:`jaxcomm.Quantize`,
:class:`jaxcomm.Cast`, and the exact mean's :class:`ExactCodec`) reduces a bucket ``x`` of
``N`` elements on device ``r`` of ``n`` as (ZeRO++'s qgZ, DeepSpeed's compressed all-reduce,
torchft's and ByteGrad's reduce in fp32):

1. **worker** (:func:`worker_stage`): ``buf = pad(x, n B L) + e_w``;
   ``wire_w, rec_w = encode(buf as (n, B, L))``; ``e_w <- buf - rec_w``.
2. **all_to_all**: row ``j`` of ``wire_w`` goes to device ``j``.
3. **server** (:func:`server_stage`): ``c = reduce(received) + e_s`` (this device's chunk of
   the mean, in fp32); ``wire_s, rec_s = encode(c)``; ``e_s <- c - rec_s``.
4. **all_gather** of ``wire_s``.
5. **finish** (:func:`finish_stage`): ``mean = decode(gathered)[:N]``, and the non-finite
   guard's verdict (:func:`stage_verdict`) read from the payloads where the codec can.

Invariant at both stages: ``input + e_old == reconstruction + e_new``. The codec is the four
methods ``chunk_layout``, ``encode``, ``reduce``, ``decode`` (and, optionally, the verdict
hooks); the stages are written once, here. The *transport* is how the two exchanges happen:

* in one XLA program over a mesh axis (:class:`AxisTransport`, what
  :meth:`StagedCodec.all_reduce` runs: ``jc.compressed_pmean``, the optimizers);
* over a tuple of axes, slowest first: an exact reduce-scatter over the fast axes hands each
  device a share of the bucket, and the stages run on that share over the slow axis
  (:mod:`jaxcomm.comm.two_level`);
* as three device programs with host exchanges between them (DiLoCo's background sync:
  :mod:`jaxcomm.optim.diloco.programs` runs the stages, :mod:`jaxcomm.runtime.host_links`
  moves the wires over TCP).

A new compressor implements the codec once and works in every transport.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying, varying_like
from jaxcomm.compressors._base import Compressor, rank_major_pending, rank_major_share
from jaxcomm.compressors.buckets import ceil_div
from jaxcomm.fusion import verdict_first, write_or_keep
from jaxcomm.guard import probes_finite

#: A payload: the arrays one stage sends, each with a leading ``(n, ...)`` row per destination
#: at the worker stage.
Wire = tuple[jax.Array, ...]


class TwoStageState(NamedTuple):
    """Error feedback of one all-reduce bucket of a staged codec (fp32, per device).

    Attributes:
      worker_error: ``(n * c,)`` residual of this device's encoding of its padded input.
      server_error: ``(c,)`` residual of this device's re-encoding of its reduced chunk
        (``c = B * L``, the padded chunk of :meth:`StagedCodec.chunk_layout`).
    """

    worker_error: jax.Array
    server_error: jax.Array


class TwoStageScatterState(NamedTuple):
    """Error feedback of one reduce-scatter bucket of a staged codec: ``(n * c,)``."""

    worker_error: jax.Array


class Transport(Protocol):
    """How the two exchanges of the stages happen (see the module docstring)."""

    def all_to_all(self, wire: Wire) -> Wire:
        """Row ``j`` of each ``(n, ...)`` array to device ``j``; row ``i`` of the result from
        device ``i``."""
        ...

    def all_gather(self, wire: Wire) -> Wire:
        """Every device's arrays, stacked ``(n, ...)``, the same on every device."""
        ...

    def on_every_device(self, flag: jax.Array) -> jax.Array:
        """Whether a bool scalar is true on every device (the same on every device)."""
        ...


@dataclass(frozen=True)
class AxisTransport:
    """The exchanges as XLA collectives over ``axis_name``, inside one program."""

    axis_name: Any

    def all_to_all(self, wire: Wire) -> Wire:
        return tuple(
            lax.all_to_all(ensure_varying(w, self.axis_name), self.axis_name, 0, 0, tiled=True)
            for w in wire
        )

    def all_gather(self, wire: Wire) -> Wire:
        return tuple(all_gather_replicated(w, self.axis_name) for w in wire)

    def on_every_device(self, flag: jax.Array) -> jax.Array:
        flag = ensure_varying(flag.astype(jnp.int32), self.axis_name)
        return lax.pmin(flag, self.axis_name) > 0


class StagedCodec(Compressor):
    """A compressor defined by its codec; the stages and the collectives are generic.

    Subclasses are frozen dataclasses with an ``error_feedback`` attribute and implement:

    * :meth:`chunk_layout`: the ``(B, L)`` blocks of each device's chunk;
    * :meth:`encode`: ``(..., B, L)`` fp32 values -> ``(wire, reconstruction)``;
    * :meth:`reduce`: the received worker wires -> this device's chunk of the mean (or sum);
    * :meth:`decode`: a wire -> the ``(..., B, L)`` values it stands for.

    The verdict hooks (:meth:`wire_finite`, :meth:`received_finite`,
    :meth:`keeps_old_worker_error`, :meth:`settle_server_error`) default to checking the
    decoded values and keeping every residual of a non-finite bucket.
    """

    error_feedback: bool
    returns_mean = True
    # All-reduce state leaves arrive as the (1, *local) blocks shard_map hands them and go back
    # in that shape, so that XLA updates the donated residuals in place (see Compressor).
    _takes_state_blocks = True

    # -- the codec -----------------------------------------------------------------------------

    @abc.abstractmethod
    def chunk_layout(self, chunk_numel: int) -> tuple[int, int]:
        """``(B, L)``: a chunk of ``chunk_numel`` elements padded to ``B`` blocks of ``L``."""

    @abc.abstractmethod
    def encode(self, blocks: jax.Array, divisor: int) -> tuple[Wire, jax.Array]:
        """``blocks`` ``(..., B, L)`` as a wire and its reconstruction (what the receivers
        will decode, in the units of ``blocks``). ``divisor`` is ``n`` at the worker stage
        (``blocks`` is then ``(n, B, L)``; a codec may pre-divide by it) and 1 at the server
        stage."""

    @abc.abstractmethod
    def reduce(self, received: Wire, axis_size: int) -> jax.Array:
        """The server stage's reduction: the ``(B, L)`` fp32 mean over the leading (source
        device) axis of the received worker wires (the sum if not ``returns_mean``)."""

    @abc.abstractmethod
    def decode(self, wire: Wire) -> jax.Array:
        """The ``(..., B, L)`` fp32 values a wire stands for."""

    # -- the verdict ---------------------------------------------------------------------------

    def wire_finite(self, wire: Wire, numel: int, length: int) -> jax.Array | None:
        """Values that are all finite exactly when the first ``numel`` elements of
        ``decode(wire)`` (flattened, blocks of ``length``) are, read without decoding (e.g.
        the block scales); ``None`` when the codec knows none (the guard then checks the
        decoded values and the new residuals)."""
        del wire, numel, length
        return None

    def received_finite(self, received: Wire) -> jax.Array | None:
        """Whether every worker wire this device received is finite (a bool scalar), for
        :meth:`keeps_old_worker_error` and :meth:`settle_server_error`; ``None``: unused."""
        del received
        return None

    def keeps_old_worker_error(self, finite: jax.Array, received_ok: Any) -> jax.Array:
        """Whether a guarded bucket keeps its old worker residual: when its mean is not
        ``finite``."""
        del received_ok
        return ~finite

    def settle_server_error(
        self, finite: jax.Array, received_ok: Any, new: jax.Array, old: jax.Array
    ) -> jax.Array:
        """A guarded bucket's server residual: the new one when its mean is ``finite``, else
        the old one."""
        del received_ok
        return jnp.where(finite, new, old)

    def staged_codec(self) -> StagedCodec:
        return self

    # -- state ---------------------------------------------------------------------------------

    def init_all_reduce_state(self, numel: int, axis_size: int) -> TwoStageState | tuple:
        if not self.error_feedback:
            return ()
        blocks, length = self.chunk_layout(ceil_div(numel, axis_size))
        chunk = blocks * length
        return TwoStageState(
            worker_error=jnp.zeros((axis_size * chunk,), jnp.float32),
            server_error=jnp.zeros((chunk,), jnp.float32),
        )

    def init_reduce_scatter_state(self, row_numel: int, axis_size: int):
        if not self.error_feedback:
            return ()
        blocks, length = self.chunk_layout(row_numel)
        return TwoStageScatterState(jnp.zeros((axis_size * blocks * length,), jnp.float32))

    # -- the stages over one mesh axis ---------------------------------------------------------

    def all_reduce(self, flat, state, *, axis_name, axis_size):
        out, new, _ = self._staged(flat, state, AxisTransport(axis_name), axis_size, False)
        return out, new

    def guarded_all_reduce_bucket(self, flat, state, bucket, *, axis_name, axis_size):
        """The stages with the non-finite guard, the verdict read from the payloads where the
        codec can (:meth:`wire_finite`: no pass over the output or the new residuals).

        On GPU, with a worker probe, the inputs' verdict comes first (:func:`checked_worker`:
        one bool ``pmin`` before the exchange), so that the pass that encodes the bucket
        writes the new worker residual or keeps the old one; a non-finite server chunk
        (finite inputs whose mean overflowed) then keeps only the server residuals.
        Elsewhere, or without a probe, each residual is written once, kept or replaced,
        after the exchange (:meth:`keeps_old_worker_error`, :meth:`settle_server_error`)."""
        if not self.error_feedback:
            return super().guarded_all_reduce_bucket(
                flat, state, bucket, axis_name=axis_name, axis_size=axis_size
            )
        return self._staged(flat, state, AxisTransport(axis_name), axis_size, True)

    def _staged(self, flat, state, transport: Transport, axis_size: int, guard: bool):
        if not (guard and self.error_feedback):
            return self._stages(flat, state, transport, axis_size, guard, False)

        def stages(first):
            return lambda flat, state: self._stages(flat, state, transport, axis_size, True, first)

        return verdict_first(stages(True), stages(False), flat, state)

    def _stages(self, flat, state, transport, axis_size: int, guard: bool, first: bool):
        numel = flat.shape[0]
        layout = self.chunk_layout(ceil_div(numel, axis_size))
        ef = self.error_feedback
        worker = worker_stage(self, flat, state.worker_error if ef else None, layout, axis_size)
        checked = first and worker.probe is not None
        if checked:
            worker, inputs_ok = checked_worker(worker, state.worker_error, transport)
        received = transport.all_to_all(worker.wire)
        server = server_stage(self, received, state.server_error if ef else None, layout)
        gathered = transport.all_gather(server.wire)
        if worker.error is None or server.error is None:  # no error feedback
            return finish_stage(self, gathered, numel, axis_size), state, None
        new = TwoStageState(
            worker.error.reshape(state.worker_error.shape),
            server.error.reshape(state.server_error.shape),
        )
        if not guard:
            return finish_stage(self, gathered, numel, axis_size), new, None
        out, finite = guarded_finish(self, worker.probe, gathered, numel, layout, axis_size, new)
        if checked:
            # The worker payloads were finite exactly when the inputs were (zeros otherwise).
            server_error = self.settle_server_error(
                finite, inputs_ok, new.server_error, state.server_error
            )
            # Replicated here; typed as the verdict after the exchange is (by this device's
            # payload), which the other form returns.
            finite = varying_like(finite, worker.error)
            return out, new._replace(server_error=server_error), finite
        return out, settle(self, finite, server.received_ok, new, state), finite

    def reduce_scatter(self, rows, state, *, axis_name, axis_size):
        """Stages 1-3 without re-encoding: this device keeps its fp32 chunk of the mean."""
        row_numel = rows.shape[1]
        layout = self.chunk_layout(row_numel)
        blocks, length = layout
        flat = jnp.pad(rows, ((0, 0), (0, blocks * length - row_numel))).reshape(-1)
        ef = self.error_feedback
        worker = worker_stage(self, flat, state.worker_error if ef else None, layout, axis_size)
        received = AxisTransport(axis_name).all_to_all(worker.wire)
        row = self.reduce(received, axis_size).reshape(-1)[:row_numel]
        return row, (TwoStageScatterState(worker.error) if ef else state)

    def all_gather(self, row, *, axis_name, axis_size):
        """Each device's row is encoded, gathered and decoded (lossy, no feedback)."""
        row_numel = row.shape[0]
        blocks, length = self.chunk_layout(row_numel)
        buf = jnp.pad(row.astype(jnp.float32), (0, blocks * length - row_numel))
        wire, _ = self.encode(buf.reshape(blocks, length), 1)
        gathered = AxisTransport(axis_name).all_gather(
            tuple(ensure_varying(w, axis_name) for w in wire)
        )
        out = self.decode(gathered).reshape(axis_size, -1)[:, :row_numel]
        return out.astype(row.dtype)

    # -- host-side resize of the error feedback ------------------------------------------------
    # All-reduce: T = sum_r w_r[:N] + n * S[:N] with S = concat_r server_error_r (server chunk
    # r covers [r c, (r+1) c); the server residual is in the units of the mean). The residual
    # in padding positions is not gradient information and is dropped. Reduce-scatter: the
    # worker residuals' rank-major rows, mapped back to the bucket's coordinates.

    def pending_sum(self, states: Sequence[Any], bucket, op: str) -> np.ndarray | None:
        if not self.error_feedback:
            return super().pending_sum(states, bucket, op)
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


# -- the stages -------------------------------------------------------------------------------


class WorkerOut(NamedTuple):
    """The worker stage on one device: ``wire`` (rows to all_to_all), the new worker residual
    (``None`` without error feedback) and the values that say whether it is finite
    (:meth:`StagedCodec.wire_finite` of this device's payload, ``None`` if the codec knows
    none)."""

    wire: Wire
    error: jax.Array | None
    probe: jax.Array | None


class ServerOut(NamedTuple):
    """The server stage on one device: ``wire`` (to all_gather), the new server residual
    (``None`` without error feedback), :meth:`StagedCodec.received_finite`."""

    wire: Wire
    error: jax.Array | None
    received_ok: jax.Array | None


def worker_stage(
    codec: StagedCodec, flat: jax.Array, error: jax.Array | None, layout, axis_size: int
) -> WorkerOut:
    """Stage 1: ``flat`` (a bucket, ``N`` elements) padded to ``n B L``, plus ``error`` (the
    worker residual, flat or a ``(1, n B L)`` block), encoded as ``n`` rows."""
    blocks, length = layout
    padded = axis_size * blocks * length
    buf = jnp.pad(flat, (0, padded - flat.shape[0]))
    if error is not None:
        buf = buf + error
    wire, recon = codec.encode(buf.reshape(axis_size, blocks, length), axis_size)
    new = buf - recon.reshape(-1) if error is not None else None
    probe = codec.wire_finite(wire, padded, length) if error is not None else None
    return WorkerOut(tuple(wire), new, probe)


def checked_worker(
    worker: WorkerOut, old_error: jax.Array, transport: Transport
) -> tuple[WorkerOut, jax.Array]:
    """The worker stage once every device's input is known finite: the verdict first.

    ``ok``, whether :attr:`WorkerOut.probe` is finite on every device, costs one bool
    exchange before the payload's; then the pass that encodes the bucket writes either the
    new worker residual or the old one (it reads the old one anyway: ``x + e_w``). Deciding
    after the exchange instead takes a pass of its own, reading the bucket again. On a step
    that is not ``ok`` the payload is zeros, the old residual is kept, and the probe becomes
    NaN, so that :func:`guarded_finish` says not finite. Returns the stage and ``ok``."""
    assert worker.probe is not None and worker.error is not None  # a guarded staged codec
    ok = transport.on_every_device(probes_finite([worker.probe]))
    old = old_error.reshape(worker.error.shape)
    wire = tuple(jnp.where(ok, w, jnp.zeros_like(w)) for w in worker.wire)
    probe = jnp.where(ok, jnp.float32(0), jnp.float32(jnp.nan))
    return WorkerOut(wire, jnp.where(ok, worker.error, old), probe), ok


def server_stage(codec: StagedCodec, received: Wire, error: jax.Array | None, layout) -> ServerOut:
    """Stage 3: this device's chunk of the mean from the ``received`` worker rows, plus
    ``error`` (the server residual), re-encoded."""
    blocks, length = layout
    axis_size = received[0].shape[0]
    chunk = codec.reduce(received, axis_size)
    if error is not None:
        chunk = chunk + error.reshape(blocks, length)
    wire, recon = codec.encode(chunk, 1)
    new = (chunk - recon).reshape(-1) if error is not None else None
    received_ok = codec.received_finite(received) if error is not None else None
    return ServerOut(tuple(wire), new, received_ok)


def finish_stage(codec: StagedCodec, gathered: Wire, numel: int, axis_size: int) -> jax.Array:
    """Stage 5: the bucket's mean (``numel`` elements) from the gathered server wires."""
    out = codec.decode(gathered).reshape(-1)[:numel]
    return out if codec.returns_mean else out / axis_size


def guarded_finish(
    codec: StagedCodec,
    worker_probe: jax.Array | None,
    gathered: Wire,
    numel: int,
    layout,
    axis_size: int,
    new: Any,
) -> tuple[jax.Array, jax.Array]:
    """Stage 5 with the non-finite guard's verdict: ``(mean, finite)``, ``finite`` a bool
    scalar saying whether the bucket's mean and this device's ``new`` residuals are finite.

    Read from this device's worker payload (``worker_probe``, :attr:`WorkerOut.probe`) and
    every device's server payload where the codec can (:meth:`StagedCodec.wire_finite`: its
    input is finite iff its worker wire is, every chunk iff the gathered wires are), with no
    pass over the mean or the residuals, and the mean is then decoded by
    :func:`~jaxcomm.fusion.write_or_keep`: the mean, or NaN everywhere (a bucket's mean is
    finite or NaN as a whole, whichever payload carried the non-finite values); else from
    the values themselves.
    """
    gathered_probe = codec.wire_finite(gathered, numel, layout[1])
    if worker_probe is None or gathered_probe is None:
        mean = finish_stage(codec, gathered, numel, axis_size)
        return mean, probes_finite([mean, *jax.tree_util.tree_leaves(new)])
    finite = probes_finite([worker_probe, gathered_probe])

    def nan(gathered):
        out = jnp.full((numel,), jnp.nan, jnp.float32)
        for wire in gathered:  # typed as the decoding (over a tuple: varying over the fast axes)
            out = varying_like(out, wire)
        return out

    def decode(gathered):
        return finish_stage(codec, gathered, numel, axis_size)

    return write_or_keep(finite, decode, nan, gathered), finite


def settle(codec: StagedCodec, finite: jax.Array, received_ok, new, old) -> TwoStageState:
    """The guarded bucket's state: each residual new or old, as the codec's policy says."""
    keep_worker = codec.keeps_old_worker_error(finite, received_ok)
    return TwoStageState(
        jnp.where(keep_worker, old.worker_error, new.worker_error),
        codec.settle_server_error(finite, received_ok, new.server_error, old.server_error),
    )


def unrolled_sum(decode, wire: Wire, axis_size: int) -> jax.Array:
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
