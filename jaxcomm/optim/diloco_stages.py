"""The compressed mean of a background DiLoCo sync, in three device programs.

:func:`jaxcomm.compressed_pmean` runs a two-stage compressor (``jc.Quantize``, ``jc.Cast``) as
``encode -> all_to_all -> decode, reduce in fp32, re-encode -> all_gather -> decode``, inside
one XLA program. A background sync runs the same arithmetic, the compressor's own code, with
the two collectives lifted out to the host (:mod:`jaxcomm.optim.diloco_exchange`):

* ``worker``: each device pads and flattens its outer gradient's buckets, adds its worker
  residual, encodes (the wire to all_to_all) and keeps the new residual;
* ``server``: each device reduces the rows it received to its chunk of the mean in fp32, adds
  its server residual and re-encodes (the wire to all_gather);
* ``finish``: every device decodes the gathered chunks into the mean and runs the check of the
  non-finite guard of :mod:`jaxcomm.comm.reduce` (is the mean or a new residual not finite?)
  and its count; the host then keeps, on each device whose check failed, the old residuals:
  the same state as the guard's select, without a pass over them.

Only what the later stages read of the old state is copied at the worker stage (the server
residuals and the count: the next step donates the state); the old worker residuals stay in
the state, where the guard finds them when the sync is merged.

The exact mean (``compressor=None``) takes the same path with an fp32 "codec" that sends the
values themselves: a reduce-scatter and an all-gather whose chunk sums are taken in device
order (``lax.psum``'s order on XLA:CPU for two devices; within ``(n - 1)`` fp32 roundings of it
for more).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxcomm.comm.buckets import Bucket, ceil_div, flatten_bucket, unflatten_bucket
from jaxcomm.comm.state import ReduceState, plan_tree
from jaxcomm.compressors import Compressor, NoCompression, OneBit
from jaxcomm.compressors._base import probes_finite
from jaxcomm.compressors._two_stage import ReduceInFp32
from jaxcomm.optim import diloco_onebit_stages as onebit

PyTree = Any


def check_staged(compressor: Compressor) -> None:
    """Refuse, with the fix, a compressor whose chain the background sync cannot stage."""
    if isinstance(compressor, NoCompression | ReduceInFp32 | OneBit):
        return
    raise ValueError(
        f"jaxcomm: diloco(background=True) runs the outer gradient's reduction as device "
        f"programs around host exchanges, which it can do for compressor=None, jc.Quantize, "
        f"jc.Cast and jc.OneBit; got {compressor!r}: use one of these, or background=False"
    )


class Plan(NamedTuple):
    """Static layout of one fragment's reduction: its buckets and their block layouts."""

    buckets: tuple[Bucket, ...]
    layouts: tuple[tuple[int, int], ...]  # (blocks B, length L) of each bucket's chunk
    guarded: bool  # error feedback: the residuals go through the non-finite guard


def plan(compressor, leaves, bucket_bytes, axis_size: int) -> Plan:
    _, _, buckets = plan_tree(list(leaves), compressor, bucket_bytes)
    if isinstance(compressor, OneBit):  # its layout is in its state: (Np,) and (Np / n,)
        return Plan(tuple(buckets), (), True)
    layouts = []
    for b in buckets:
        chunk = ceil_div(b.numel, axis_size)
        layouts.append(
            (1, chunk) if isinstance(compressor, NoCompression) else compressor._layout(chunk)
        )
    guarded = isinstance(compressor, ReduceInFp32) and compressor.error_feedback
    return Plan(tuple(buckets), tuple(layouts), guarded)


def _encode(compressor, blocks, divisor):
    if isinstance(compressor, NoCompression):
        return (blocks,), blocks
    return compressor._encode(blocks, divisor)


def _decode(compressor, wire):
    if isinstance(compressor, NoCompression):
        return wire[0]
    return compressor._decode(wire)


def _reduce(compressor, wire, n):
    """This device's chunk of the mean (two-stage) or of the sum (exact) of the rows."""
    if isinstance(compressor, NoCompression):
        total = wire[0][0]
        for j in range(1, n):
            total = total + wire[0][j]
        return total
    return compressor._reduce_mean(wire, n)


def worker(compressor, p: Plan, leaves, comm: ReduceState, n: int):
    """Stage 1 on one device: ``(wires, worker residuals)``; ``wires[k]`` is bucket ``k``'s
    tuple of ``(n, ...)`` arrays, row ``q`` for device ``q``."""
    if isinstance(compressor, OneBit):
        return onebit.worker(p.buckets, leaves, comm, n)
    wires, residuals = [], []
    for k, (bucket, (blocks, length)) in enumerate(zip(p.buckets, p.layouts, strict=True)):
        flat = flatten_bucket(leaves, bucket)
        buf = jnp.pad(flat, (0, n * blocks * length - bucket.numel))
        if p.guarded:
            buf = buf + comm.buckets[k].worker_error
        wire, recon = _encode(compressor, buf.reshape(n, blocks, length), n)
        wires.append(tuple(wire))
        residuals.append(buf - recon.reshape(-1) if p.guarded else None)
    return wires, residuals


def kept(p: Plan, comm: ReduceState):
    """Copies of what the server and finish stages read of the old state: each bucket's server
    residual and the non-finite count (``()`` without error feedback)."""
    if not p.guarded:
        return ()
    return [jnp.copy(b.server_error) for b in comm.buckets], jnp.copy(comm.nonfinite)


def server(compressor, p: Plan, received, kept, n: int):
    """Stage 2 on one device: ``(wires to gather, server residuals)``; ``kept``: from
    :func:`kept`."""
    if isinstance(compressor, OneBit):
        return onebit.server(p.buckets, received, kept, n)
    wires, residuals = [], []
    for k, (blocks, length) in enumerate(p.layouts):
        chunk = _reduce(compressor, received[k], n)
        if p.guarded:
            chunk = chunk + kept[0][k].reshape(blocks, length)
        wire, recon = _encode(compressor, chunk, 1)
        wires.append(tuple(wire))
        residuals.append((chunk - recon).reshape(-1) if p.guarded else None)
    return wires, residuals


def finish(compressor, p: Plan, gathered, workers, servers, kept, n: int):
    """Stage 3 on every device: ``(the mean's leaves in fragment order, flags)``; ``flags``:
    ``()`` without error feedback, else ``(bad, count)``: whether the mean or a new residual
    is not finite (the guard keeps the old residuals) and the non-finite count after it;
    OneBit's also settles the server residuals (:func:`diloco_onebit_stages.finish`)."""
    if isinstance(compressor, OneBit):
        return onebit.finish(p.buckets, gathered, servers, kept)
    num_leaves = sum(len(b.leaf_ids) for b in p.buckets)
    out: list = [None] * num_leaves
    bad = jnp.bool_(False)
    for k, bucket in enumerate(p.buckets):
        mean = _decode(compressor, gathered[k]).reshape(-1)[: bucket.numel]
        if isinstance(compressor, NoCompression):
            mean = mean / n
        if p.guarded:
            # A codec that knows its output's finiteness from its scales spares a pass.
            probe = compressor._decoded_finite_probe(gathered[k], bucket.numel, p.layouts[k][1])
            bad = bad | ~probes_finite((mean if probe is None else probe, workers[k], servers[k]))
        for i, leaf in zip(bucket.leaf_ids, unflatten_bucket(mean, bucket), strict=True):
            out[i] = leaf
    if not p.guarded:
        return out, ()
    # Any bucket not finite skips the whole sync: every bucket keeps its error feedback.
    return out, (bad, kept[1] + bad.astype(jnp.int32))
