"""The two-level transport: exact over the fast axes, compressed only across the slow one.

With ``axis_name=("host", "local")`` (slowest first, :mod:`jaxcomm.comm.axes`) a bucket of
``N`` elements on ``n = S * L`` devices (``S`` hosts of ``L`` devices) is all-reduced as:

1. exact reduce-scatter over the fast axes (the sum, or the mean, in the bucket's compute dtype,
   fp32 for the lossy compressors): device ``(s, l)`` holds share ``l`` of its host's
   reduction, ``c = ceil(N / L)`` elements;
2. the compressor's all-reduce of that share across the slow axis, with the share's error
   feedback (so each device keeps ``1/L`` of the error feedback a flat axis would);
3. exact all-gather of the shares over the fast axes.

Only step 2 crosses the slow link. Per device it carries what the compressor sends for ``c``
elements over ``S`` devices, e.g. 1-bit: about ``2 (S - 1)/S * c/8`` bytes, against
``2 (n - 1)/n * N/8`` on one flat axis of all ``n`` devices and ``2 (n - 1)/n * 4 N`` for an
exact fp32 all-reduce. The fast axes carry ``2 (L - 1)/L * 4 N`` exact bytes (NVLink, ICI).

A reduce-scatter over the tuple gives device ``(s, l)`` row ``s L + l`` of the rank-major
layout of ``n`` rows, as over one flat axis of ``n`` devices: the rows are reduced exactly over
the fast axes first (device ``l`` keeps the ``S`` rows ``s L + l``), then the compressor
reduce-scatters those ``S`` rows across the slow axis. The all-gather is the inverse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying
from jaxcomm.compressors.buckets import Bucket, ceil_div


def share_bucket(bucket: Bucket, slow_size: int, fast_size: int, op: str) -> Bucket:
    """The bucket the slow axis's compressor sees: one 1-D leaf.

    All-reduce: the ``ceil(N / L)`` elements of one fast share. Reduce-scatter: the ``S`` rows
    of ``C`` (the bucket's row length over ``S L`` devices) that one fast device reduces across
    the slow axis, so that the compressor's own row length over ``S`` devices is ``C``.
    """
    if op == "all_reduce":
        numel = ceil_div(bucket.numel, fast_size)
    else:
        numel = slow_size * bucket.shard_numel(slow_size * fast_size)
    return Bucket(
        leaf_ids=(0,),
        shapes=((numel,),),
        dtypes=(bucket.dtype,),
        dtype=bucket.dtype,
        exact=bucket.exact,
    )


def scatter_share(buf: jax.Array, fast: tuple[str, ...], fast_size: int, mean: bool):
    """Step 1: this device's ``(ceil(N / L),)`` share of the exact sum (or mean) of ``buf``
    (``(N,)``) over the fast axes."""
    numel = buf.shape[0]
    share = ceil_div(numel, fast_size)
    rows = jnp.pad(buf, (0, fast_size * share - numel)).reshape(fast_size, share)
    out = lax.psum_scatter(ensure_varying(rows, fast), fast, scatter_dimension=0)
    return out / fast_size if mean else out


def gather_shares(share: jax.Array, fast: tuple[str, ...], numel: int) -> jax.Array:
    """Step 3: every fast device's share, concatenated and cut to ``numel`` (replicated)."""
    rows = all_gather_replicated(ensure_varying(share, fast), fast)
    return rows.reshape(-1)[:numel]


def scatter_rows(rows: jax.Array, fast: tuple[str, ...], slow_size: int, fast_size: int):
    """Reduce-scatter, step 1: ``(S L, C)`` rank-major rows -> the ``(S, C)`` rows ``s L + l``
    (``s < S``) of this fast device ``l``, summed exactly over the fast axes."""
    width = rows.shape[1]
    by_fast = rows.reshape(slow_size, fast_size, width).transpose(1, 0, 2)
    return lax.psum_scatter(ensure_varying(by_fast, fast), fast, scatter_dimension=0)


def gather_rows(rows: jax.Array, fast: tuple[str, ...], slow_size: int, fast_size: int):
    """All-gather, last step: every fast device's ``(S, C)`` rows -> the ``(S L, C)``
    rank-major rows of all ``S L`` devices (replicated)."""
    gathered = all_gather_replicated(ensure_varying(rows, fast), fast)  # (L, S, C)
    return gathered.transpose(1, 0, 2).reshape(slow_size * fast_size, -1)
