"""The 1-bit mean of a background DiLoCo sync, in three device programs.

:class:`jaxcomm.OneBit` reduces a bucket as ``compress -> all_to_all -> server sum and
recompress -> all_gather -> decode`` inside one XLA program. A background sync runs the same
arithmetic (the functions of :mod:`jaxcomm.compressors.signs`) with the two collectives lifted
out to the host, as :mod:`jaxcomm.optim.diloco_stages` does for the fp32-reduction codecs:

* ``worker``: each device adds its worker residual to its padded pseudo-gradient, sends the
  packed signs of each chunk with the buffer's scale, and keeps the new worker residual;
* ``server``: each device sums the scaled signs it received into its chunk (plus its server
  residual), packs that chunk's signs with its own scale, and proposes its new server residual;
* ``finish``: every device decodes the gathered chunks into the mean, and the non-finite guard
  decides the error feedback exactly as OneBit's guarded all-reduce and DiLoCo's skipped sync
  do in one program:

  - a worker scale that is not finite (a non-finite input anywhere) keeps every residual and
    makes the mean NaN;
  - a server scale that is not finite with finite inputs (an overflowing server sum) restarts
    the server residuals from zero and makes the mean NaN;
  - with more than one bucket, any bucket whose mean is not finite skips the whole sync: every
    bucket keeps its old residuals (DiLoCo keeps the error feedback of a skipped sync).

  The decision is the same on every device (it is read from scales every device received).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxcomm.comm.buckets import flatten_bucket
from jaxcomm.compressors.signs import (
    decode_leaves,
    l2_scale,
    residual,
    server_chunk,
    server_payload,
    signs_and_scales,
    weighted_sign_sum,
    worker_payload,
)


def worker(buckets, leaves, comm, n: int):
    """Stage 1 on one device: ``(wires, worker residuals)``; ``wires[k]`` is bucket ``k``'s
    ``((n, M + 4) bytes,)``, row ``q`` for device ``q``."""
    wires, residuals = [], []
    for k, bucket in enumerate(buckets):
        error = comm.buckets[k].worker_error
        buf = jnp.pad(flatten_bucket(leaves, bucket), (0, error.shape[0] - bucket.numel)) + error
        scale = l2_scale(buf)
        wires.append((worker_payload(buf, scale, n),))
        residuals.append(residual(buf, scale))
    return wires, residuals


def server(buckets, received, kept, n: int):
    """Stage 2 on one device: ``(wires to gather, proposals)``; a proposal is ``(server
    residual, whether every worker scale was finite)``, settled by :func:`finish`."""
    wires, proposals = [], []
    for k in range(len(buckets)):
        signs, scales = signs_and_scales(received[k][0])
        finite = jnp.all(jnp.isfinite(scales))
        old_rows = kept[0][k].reshape(signs.shape[1], 8)
        c, scale = server_chunk(old_rows, weighted_sign_sum(signs, scales / n), finite)
        wires.append((server_payload(c, scale),))
        proposals.append((residual(c, scale).reshape(-1), finite))
    return wires, proposals


def finish(buckets, gathered, proposals, kept):
    """Stage 3 on every device: ``(the mean's leaves in fragment order, (keep_old, count,
    server residuals))``: ``keep_old`` says whether this device keeps its old worker and server
    residuals, ``count`` is the non-finite count after the sync."""
    out: list = [None] * sum(len(b.leaf_ids) for b in buckets)
    any_bad, servers = jnp.bool_(False), []
    for k, bucket in enumerate(buckets):
        signs, scales = signs_and_scales(gathered[k][0])
        ok = jnp.all(jnp.isfinite(scales))
        # Decoded straight into the leaves (no flat mean to cut them from): NaN when not ok.
        leaves = lax.cond(
            ok,
            lambda s, c, shapes=bucket.shapes: decode_leaves(s, c, shapes),
            lambda s, c, shapes=bucket.shapes: [jnp.full(x, jnp.nan, jnp.float32) for x in shapes],
            signs,
            scales,
        )
        proposal, finite = proposals[k]
        servers.append(jnp.where(ok, proposal, jnp.where(finite, 0.0, kept[0][k])))
        any_bad = any_bad | ~ok
        for i, leaf, dtype in zip(bucket.leaf_ids, leaves, bucket.dtypes, strict=True):
            out[i] = leaf.astype(dtype)
    # One bucket: OneBit's guard keeps the residuals when a worker scale was not finite; more:
    # DiLoCo's skipped sync keeps every bucket's when any mean was not finite.
    keep_old = any_bad if len(buckets) > 1 else ~proposals[0][1]
    return out, (keep_old, kept[1] + any_bad.astype(jnp.int32), servers)
