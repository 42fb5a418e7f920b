"""Buckets and their layouts: the plan, the flatten/unflatten steps, shard math, the bucket loop.

DeepSpeed coalesces many small tensors into one flat buffer so that one collective replaces
hundreds (``reduce_scatter_coalesced``, the 1-bit optimizers' flat momentum). Here the same is done
with ``jax.tree_util``: the *plan* (which leaves go in which bucket, at which offsets) is static
Python data computed from shapes and dtypes at trace time, and the flatten/unflatten steps are
plain ``jnp`` ops that XLA fuses.

Two layouts are used:

* **concatenated** (all-reduce): the bucket's leaves flattened and concatenated in tree order,
  length ``N = sum(numel_i)``.
* **rank-major** (reduce-scatter / all-gather, DeepSpeed's ``reduce_scatter_coalesced``): leaf ``i``
  is zero-padded to ``n * c_i`` with ``c_i = ceil(numel_i / n)``; row ``r`` of the ``(n, C)``
  buffer, ``C = sum(c_i)``, holds ``[r*c_i, (r+1)*c_i)`` of every leaf, so device ``r`` receives
  its slice of every leaf from one collective.

The rank-major conversions exist once, for ``jnp`` and NumPy alike (``xp=``): the collectives
build it on device, :mod:`jaxcomm.elastic.resize` re-cuts error feedback on the host.
:func:`map_buckets` is the one loop over buckets that every collective (and
:mod:`jaxcomm.comm.backend`) runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints, without floats."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``."""
    return ceil_div(value, multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    """Static description of one bucket: which leaves it holds and how they are laid out.

    Attributes:
      leaf_ids: positions of the bucket's leaves in the flattened tree, in tree order.
      shapes: the leaves' shapes.
      dtypes: the leaves' dtypes (restored after the collective).
      dtype: the buffer dtype the collective runs in.
      exact: True for integer/bool leaves, which are always reduced exactly.
    """

    leaf_ids: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    dtype: np.dtype
    exact: bool

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        """Length ``N`` of the concatenated layout."""
        return sum(self.sizes)

    def shard_sizes(self, n: int) -> tuple[int, ...]:
        """Per-device slice length ``c_i = ceil(numel_i / n)`` of each leaf."""
        return tuple(ceil_div(size, n) for size in self.sizes)

    def shard_numel(self, n: int) -> int:
        """Row length ``C = sum(c_i)`` of the rank-major layout."""
        return sum(self.shard_sizes(n))


def is_exact_dtype(dtype) -> bool:
    """Integer and bool leaves are never compressed: a lossy integer sum is a silent bug."""
    return not jnp.issubdtype(dtype, jnp.inexact)


def check_leaves(leaves: Sequence, names: Sequence[str] | None = None) -> None:
    """Reject leaves jaxcomm cannot reduce, naming the offending one (by ``names[i]``, its path
    in the tree, when given; else by its index)."""
    for i, leaf in enumerate(leaves):
        name = names[i] if names is not None else str(i)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            number = isinstance(leaf, int | float)
            hint = " (wrap Python numbers with jnp.asarray)" if number else ""
            raise TypeError(
                f"jaxcomm: leaf {name} is {type(leaf).__name__}, expected an array{hint}"
            )
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            raise TypeError(f"jaxcomm: leaf {name} has complex dtype {leaf.dtype}, not supported")


def plan_buckets(
    leaves: Sequence,
    bucket_bytes: int | None,
    compute_dtype: Callable[[np.dtype], np.dtype],
) -> tuple[Bucket, ...]:
    """Group leaves into buckets.

    Leaves are taken in tree order and grouped by buffer dtype (``compute_dtype(leaf.dtype)`` for
    floating leaves, the leaf's own dtype for exact ones). With ``bucket_bytes=None`` each group is
    one bucket; otherwise a group is cut into consecutive buckets of at most about
    ``bucket_bytes`` bytes of buffer (a single larger leaf gets a bucket of its own; leaves are
    never split, so one leaf's reduction never waits on another bucket).
    """
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise ValueError(
            f"jaxcomm: bucket_bytes must be a positive int or None, got {bucket_bytes!r}"
        )
    check_leaves(leaves)
    groups: dict[tuple[np.dtype, bool], list[int]] = {}
    for i, leaf in enumerate(leaves):
        exact = is_exact_dtype(leaf.dtype)
        dtype = np.dtype(leaf.dtype) if exact else np.dtype(compute_dtype(np.dtype(leaf.dtype)))
        groups.setdefault((dtype, exact), []).append(i)

    buckets = []
    for (dtype, exact), ids in groups.items():
        current: list[int] = []
        current_bytes = 0
        for i in ids:
            nbytes = math.prod(leaves[i].shape) * dtype.itemsize
            if current and bucket_bytes is not None and current_bytes + nbytes > bucket_bytes:
                buckets.append(_make_bucket(leaves, current, dtype, exact))
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += nbytes
        if current:
            buckets.append(_make_bucket(leaves, current, dtype, exact))
    # Order buckets by their first leaf, so the first layers' gradients go out first.
    return tuple(sorted(buckets, key=lambda b: b.leaf_ids[0]))


def _make_bucket(leaves, ids: list[int], dtype: np.dtype, exact: bool) -> Bucket:
    return Bucket(
        leaf_ids=tuple(ids),
        shapes=tuple(tuple(leaves[i].shape) for i in ids),
        dtypes=tuple(np.dtype(leaves[i].dtype) for i in ids),
        dtype=dtype,
        exact=exact,
    )


def flatten_bucket(leaves: Sequence[jax.Array], bucket: Bucket) -> jax.Array:
    """Concatenated layout: the bucket's leaves as one ``(N,)`` buffer of ``bucket.dtype``."""
    parts = [jnp.ravel(leaves[i]).astype(bucket.dtype) for i in bucket.leaf_ids]
    if not parts:
        return jnp.zeros((0,), bucket.dtype)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def unflatten_bucket(flat: jax.Array, bucket: Bucket, dtypes=None) -> list[jax.Array]:
    """Inverse of :func:`flatten_bucket`; leaves come back in their own dtypes.

    ``dtypes`` overrides the per-leaf dtypes (exact mean of integers is floating, as ``lax.pmean``).
    """
    dtypes = bucket.dtypes if dtypes is None else dtypes
    return [
        piece.reshape(shape).astype(dtype)
        for piece, shape, dtype in zip(
            split_concatenated(flat, bucket), bucket.shapes, dtypes, strict=True
        )
    ]


def leaves_to_rank_major(parts: Sequence, bucket: Bucket, n: int, row_length=None, xp=jnp):
    """Per-leaf flat ``(numel_i,)`` arrays -> the ``(n, row_length)`` rank-major buffer.

    Leaf ``i`` is zero-padded to ``n * c_i`` and cut into ``n`` rows of ``c_i``; the rows are
    concatenated leaf after leaf, then zero-padded to ``row_length`` (default ``C``). ``xp`` is
    ``jnp`` (on device) or ``np`` (host).
    """
    dtype = parts[0].dtype if parts else bucket.dtype
    rows = [
        xp.pad(p, (0, n * c - size)).reshape(n, c)
        for p, size, c in zip(parts, bucket.sizes, bucket.shard_sizes(n), strict=True)
    ]
    extra = (bucket.shard_numel(n) if row_length is None else row_length) - bucket.shard_numel(n)
    if extra:
        rows.append(xp.zeros((n, extra), dtype))
    if not rows:
        return xp.zeros((n, 0), dtype)
    return rows[0] if len(rows) == 1 else xp.concatenate(rows, axis=1)


def rank_major_to_leaves(rows, bucket: Bucket, n: int) -> list:
    """Inverse of :func:`leaves_to_rank_major` from ``(n, >= C)`` rows: per-leaf ``(numel_i,)``."""
    out, offset = [], 0
    for size, c in zip(bucket.sizes, bucket.shard_sizes(n), strict=True):
        out.append(rows[:, offset : offset + c].reshape(n * c)[:size])
        offset += c
    return out


def concatenated_to_rank_major(flat, bucket: Bucket, n: int, row_length=None, xp=jnp):
    """The concatenated ``(N,)`` layout -> rank-major ``(n, row_length)`` (jnp or NumPy)."""
    return leaves_to_rank_major(split_concatenated(flat, bucket), bucket, n, row_length, xp)


def rank_major_to_concatenated(rows, bucket: Bucket, n: int, xp=jnp):
    """Rank-major ``(n, >= C)`` rows -> the concatenated ``(N,)`` layout (jnp or NumPy)."""
    parts = rank_major_to_leaves(rows, bucket, n)
    if not parts:
        return xp.zeros((0,), rows.dtype)
    return parts[0] if len(parts) == 1 else xp.concatenate(parts)


def split_concatenated(flat, bucket: Bucket) -> list:
    """The concatenated ``(N,)`` layout cut into per-leaf ``(numel_i,)`` pieces."""
    out, offset = [], 0
    for size in bucket.sizes:
        out.append(flat[offset : offset + size])
        offset += size
    return out


def flatten_bucket_rank_major(
    leaves: Sequence[jax.Array], bucket: Bucket, n: int, row_length: int | None = None
) -> jax.Array:
    """Rank-major layout: an ``(n, row_length)`` buffer, row ``r`` = device ``r``'s slices.

    ``row_length`` (default ``C``) lets a compressor ask for extra zero padding per row.
    """
    parts = [jnp.ravel(leaves[i]).astype(bucket.dtype) for i in bucket.leaf_ids]
    if not parts:
        return jnp.zeros((n, 0), bucket.dtype)
    return leaves_to_rank_major(parts, bucket, n, row_length)


def split_shard(shard: jax.Array, bucket: Bucket, n: int) -> list[jax.Array]:
    """Cut one device's row ``(C,)`` into its per-leaf slices ``(c_i,)`` (bucket dtype kept)."""
    out, offset = [], 0
    for c in bucket.shard_sizes(n):
        out.append(shard[offset : offset + c])
        offset += c
    return out


def join_shards(shards: Sequence[jax.Array], bucket: Bucket, n: int) -> jax.Array:
    """Inverse of :func:`split_shard`: per-leaf slices of one device back into its ``(C,)`` row."""
    expected = bucket.shard_sizes(n)
    for k, (s, c) in enumerate(zip(shards, expected, strict=True)):
        if s.shape != (c,):
            raise ValueError(
                f"jaxcomm: shard {k} of a bucket has shape {s.shape}, expected ({c},) for a leaf "
                f"of "
                f"shape {bucket.shapes[k]} over {n} devices"
            )
    parts = [s.astype(bucket.dtype) for s in shards]
    if not parts:
        return jnp.zeros((0,), bucket.dtype)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def unflatten_rank_major(rows: jax.Array, bucket: Bucket, n: int) -> list[jax.Array]:
    """Inverse of :func:`flatten_bucket_rank_major` from the gathered ``(n, >= C)`` buffer."""
    return [
        flat.reshape(shape).astype(dtype)
        for flat, shape, dtype in zip(
            rank_major_to_leaves(rows, bucket, n), bucket.shapes, bucket.dtypes, strict=True
        )
    ]


def map_buckets(fn: Callable, buckets: Sequence[Bucket], num_leaves: int, *per_bucket):
    """The one loop over buckets: ``fn(bucket, *xs)`` -> ``(bucket's output leaves, extra)``.

    ``per_bucket`` are sequences zipped with ``buckets`` (e.g. the bucket states). Returns the
    output leaves in tree order (each bucket's leaves put back at its ``leaf_ids``) and the list
    of each bucket's ``extra`` (e.g. its new state).
    """
    out: list = [None] * num_leaves
    extras = []
    for bucket, *xs in zip(buckets, *per_bucket, strict=True):
        leaves, extra = fn(bucket, *xs)
        for i, leaf in zip(bucket.leaf_ids, leaves, strict=True):
            out[i] = leaf
        extras.append(extra)
    return out, extras
