"""The compressor interface.

A compressor turns a flat, fp32 (or native-dtype) bucket into a collective chain. It is a frozen
dataclass, so it is hashable and can be a static argument of ``jax.jit``; its per-bucket error
feedback is a ``NamedTuple`` of arrays, so it is jit-able, shardable and checkpointable.

Every compressor implements three reductions over an axis of size ``n``:

* ``all_reduce``: ``(N,)`` buffer -> ``(N,)`` sum or mean, identical on every device;
* ``reduce_scatter``: ``(n, C)`` rank-major buffer -> this device's ``(C,)`` row of the sum/mean;
* ``all_gather``: this device's ``(C,)`` row -> ``(n, C)``.

A reduction returns whichever of sum and mean its algorithm produces (``returns_mean``); the
collectives turn it into the one the caller asked for, in one place (:mod:`jaxcomm.comm.reduce`).

Integer and bool leaves never reach a compressor: they are reduced exactly by the caller.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._compat import all_gather_replicated
from jaxcomm.compressors.buckets import (
    Bucket,
    concatenated_to_rank_major,
    rank_major_to_concatenated,
    split_concatenated,
)
from jaxcomm.guard import keep_if, probes_finite


class Compressor(abc.ABC):
    """Interface of a bucket compressor. Subclasses are frozen dataclasses."""

    #: True when reductions are lossy (MAX/MIN are then refused, since they cannot be compressed).
    lossy: bool = True

    #: True when :meth:`all_reduce` / :meth:`reduce_scatter` return the mean over the axis (the
    #: collectives multiply by ``n`` for a sum), False when they return the sum (divided by ``n``
    #: for a mean). Each compressor returns what its algorithm computes, so no rounding is added.
    returns_mean: bool = False

    #: The layout :meth:`reduce_scatter_bucket` receives: ``"rank_major"`` ``(n, C)`` rows, or
    #: ``"concatenated"`` ``(N,)`` (a compressor that reduces the whole bucket, as PowerSGD).
    scatter_layout: str = "rank_major"

    # Private hook: all_reduce_bucket and guarded_all_reduce_bucket also take and return state
    # leaves as the (1, *local) blocks shard_map hands them, so that XLA:CPU updates the donated
    # buffers in place (through a squeeze and back it writes a fresh buffer and copies it).
    _takes_state_blocks: bool = False

    #: True when a guarded bucket's fp32 output is NaN everywhere when the guard finds it not
    #: finite, and finite everywhere otherwise (OneBit: ``scale * sign``, or NaN). One element
    #: of each fp32 leaf of a mean then says whether all of it is finite: the 1-bit optimizers
    #: read it so, with no pass over the mean and no collective (the mean is replicated).
    output_decides_finite: bool = False

    #: True when the compressor works on any contiguous share of a bucket, as the two-level
    #: transport of a tuple of axes hands it (:mod:`jaxcomm.comm.two_level`); False for one
    #: that needs the leaves' own shapes (PowerSGD views leaves as matrices).
    splits_into_shares: bool = True

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
        self, flat: jax.Array, state: Any, *, axis_name: str, axis_size: int
    ) -> tuple[jax.Array, Any]:
        """Sum (or mean, see ``returns_mean``) of ``flat`` over the axis, and the new state."""

    @abc.abstractmethod
    def reduce_scatter(
        self, rows: jax.Array, state: Any, *, axis_name: str, axis_size: int
    ) -> tuple[jax.Array, Any]:
        """Row ``axis_index`` of the sum (or mean) of ``rows`` over the axis, and the new state."""

    def finite_probe(self, output: jax.Array, state: Any) -> list[jax.Array]:
        """Arrays that are all finite iff a bucket's ``output`` and new ``state`` are.

        The non-finite guard of :mod:`jaxcomm.comm.reduce` checks these. The default is the
        output and every floating state leaf; a compressor whose non-finite values always
        spread through a scale (OneBit) returns a few elements instead.
        """
        leaves = jax.tree_util.tree_leaves(state)
        return [output, *(x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact))]

    def staged_codec(self) -> Any:
        """The :class:`~jaxcomm.compressors.staged.StagedCodec` whose stages compute this
        compressor's all-reduce where its exchanges leave the program (DiLoCo's background
        sync), or ``None`` when the compressor has no such stages (PowerSGD, TopK,
        SparseLoCo)."""
        return None

    def all_gather(self, row: jax.Array, *, axis_name: str, axis_size: int) -> jax.Array:
        """Every device's row, stacked ``(n, C)``. Exact unless a compressor overrides it."""
        return all_gather_replicated(row, axis_name)

    # Bucket-aware entry points, called by jaxcomm.comm.reduce. By default they forward to the
    # flat methods above; a compressor that needs the leaves' shapes (PowerSGD views leaves as
    # matrices) overrides them. ``bucket`` is a static :class:`jaxcomm.compressors.buckets.Bucket`.

    def init_bucket_state(self, bucket: Bucket, axis_size: int, op: str) -> Any:
        """State of one bucket for ``op`` (``"all_reduce"`` or ``"reduce_scatter"``)."""
        if op == "all_reduce":
            return self.init_all_reduce_state(bucket.numel, axis_size)
        return self.init_reduce_scatter_state(bucket.shard_numel(axis_size), axis_size)

    def all_reduce_bucket(
        self, flat: jax.Array, state: Any, bucket: Bucket, *, axis_name, axis_size
    ) -> tuple[jax.Array, Any]:
        """:meth:`all_reduce` of a bucket's concatenated layout, knowing its leaves."""
        return self.all_reduce(flat, state, axis_name=axis_name, axis_size=axis_size)

    def reduce_scatter_bucket(
        self, rows: jax.Array, state: Any, bucket: Bucket, *, axis_name, axis_size
    ) -> tuple[jax.Array, Any]:
        """:meth:`reduce_scatter` of a bucket in its ``scatter_layout``, knowing its leaves."""
        return self.reduce_scatter(rows, state, axis_name=axis_name, axis_size=axis_size)

    # Guarded entry points: the non-finite guard of jaxcomm.comm.reduce, one bucket at a time.
    # Each returns ``(output, state, finite)``: ``state`` is the new state when ``finite`` (a
    # bool scalar) is true, else the old one. Buckets are guarded independently: one flag shared
    # by all buckets tied every bucket's state to every other bucket's output, and XLA copied
    # the shared check into each bucket's fusions (compile time and memory grew with the square
    # of the bucket count). The default decides from :meth:`finite_probe`; a compressor may
    # decide earlier and fuse the choice into the pass that writes its state (OneBit).

    def guarded_all_reduce_bucket(
        self, flat: jax.Array, state: Any, bucket: Bucket, *, axis_name, axis_size
    ) -> tuple[jax.Array, Any, jax.Array]:
        """:meth:`all_reduce_bucket`, keeping ``state`` when its output or new state is not
        finite."""
        out, new = self.all_reduce_bucket(
            flat, state, bucket, axis_name=axis_name, axis_size=axis_size
        )
        finite = probes_finite(self.finite_probe(out, new))
        return out, keep_if(finite, new, state), finite

    def guarded_all_reduce_leaves(
        self,
        flat: jax.Array,
        state: Any,
        bucket: Bucket,
        fallback: list[jax.Array],
        *,
        axis_name,
        axis_size,
    ) -> tuple[list[jax.Array], Any, jax.Array, list[jax.Array], Any]:
        """The bucket's *mean* as its leaves, or ``fallback`` (the leaves' shapes, in the
        compute dtype) when the mean is not finite; the state as
        :meth:`guarded_all_reduce_bucket` keeps it; whether the mean is finite (a bool
        scalar, replicated as the mean is); the mean's leaves as computed, before the
        fallback (not finite where the mean is not), for consumers that read them only where
        the mean is finite; and the mean as sent (:meth:`init_packed_mean`'s form, ``None``
        for a compressor without one).

        The default selects leaf by leaf after :meth:`guarded_all_reduce_bucket` (a pass over
        the mean); a compressor that decodes its output may write it into the leaves directly
        and return ``fallback`` from the same conditional (OneBit).
        """
        out, new, _ = self.guarded_all_reduce_bucket(
            flat, state, bucket, axis_name=axis_name, axis_size=axis_size
        )
        mean = out if self.returns_mean else out / axis_size
        leaves, finite = mean_or_fallback(mean, bucket, fallback)
        return leaves, new, finite, mean_leaves(mean, bucket), None

    # The packed mean: a bucket's all-reduce output as its last exchange carried it (the same
    # on every device), far smaller than the mean for a compressor whose output is compressed.
    # An optimizer whose next step starts from this mean (1-bit Adam's momentum) keeps it and
    # reads it back instead of the mean's leaves.

    def init_packed_mean(self, bucket: Bucket, axis_size: int) -> Any:
        """Zeros in the form of one bucket's packed mean on ``axis_size`` devices (a tuple of
        arrays), or ``None`` when the compressor has none (the default)."""
        del bucket, axis_size
        return None

    def unpack_mean(self, packed: Any, bucket: Bucket) -> list[jax.Array]:
        """The bucket's mean, as its leaves (fp32), from :meth:`init_packed_mean`'s form."""
        raise NotImplementedError(f"{type(self).__name__} has no packed mean")

    def packed_mean_squares(self, packed: Any, bucket: Bucket) -> list[jax.Array] | None:
        """Each leaf's mean of squares of :meth:`unpack_mean`'s values, from the packed form
        without a pass over the leaves, or ``None`` where the compressor cannot (the
        default): a consumer that needs a leaf's RMS then reduces the decoded leaf."""
        del packed, bucket
        return None

    def guarded_reduce_scatter_bucket(
        self, rows: jax.Array, state: Any, bucket: Bucket, *, axis_name, axis_size
    ) -> tuple[jax.Array, Any, jax.Array]:
        """:meth:`reduce_scatter_bucket`, keeping ``state`` when this device's row or new state
        is not finite."""
        row, new = self.reduce_scatter_bucket(
            rows, state, bucket, axis_name=axis_name, axis_size=axis_size
        )
        finite = probes_finite(self.finite_probe(row, new))
        return row, keep_if(finite, new, state), finite

    # Host side, in NumPy: moving one bucket's error feedback onto another number of devices
    # (jaxcomm.elastic.resize_state). A compressor owns its state's layout, so it says what the
    # state still owes the sum and how a new device holds its share of that.

    def pending_sum(self, states: Sequence[Any], bucket: Bucket, op: str) -> np.ndarray | None:
        """What one bucket's error feedback on ``n = len(states)`` devices has not transmitted
        yet: the float64 ``(N,)`` vector ``T`` (the bucket's real coordinates, the units of
        ``compressed_psum``) with ``sum_t out_t == sum_t sum_r x_{t,r} + T_start - T_end``.

        ``None``: not known (:func:`jaxcomm.elastic.resize_state` then restarts the bucket's
        error feedback at zero, with a warning). The default knows a state whose one leaf is a
        residual ``(N,)`` of the all-reduce input: ``T`` is its sum over the devices.
        """
        rows = [jax.tree_util.tree_leaves(s) for s in states]
        if op != "all_reduce" or not all(
            len(r) == 1 and np.shape(r[0]) == (bucket.numel,) for r in rows
        ):
            return None
        return sum(np.asarray(r[0], np.float64) for r in rows)

    def with_pending(
        self,
        share: np.ndarray,
        template: Any,
        bucket: Bucket,
        op: str,
        *,
        axis_size: int,
        old: Sequence[Any],
    ) -> Any:
        """One of ``axis_size`` new devices' bucket state holding ``share`` (fp32 ``(N,)``,
        ``T / axis_size``) of :meth:`pending_sum`. ``template`` is its initial state (NumPy),
        ``old`` the old devices' states (for what they share besides the error feedback)."""
        del bucket, op, axis_size, old
        return jax.tree_util.tree_structure(template).unflatten([share])


def mean_or_fallback(
    mean: jax.Array, bucket: Bucket, fallback: list[jax.Array]
) -> tuple[list[jax.Array], jax.Array]:
    """A bucket's flat ``mean`` as its leaves, or ``fallback``'s when it is not finite; and the
    flag (a bool scalar).

    Decided by :func:`probes_finite`, the one finiteness test: exact, so finite values whose
    sum would pass the fp32 range keep the mean.
    """
    finite = probes_finite([mean])
    leaves = mean_leaves(mean, bucket)
    return [jnp.where(finite, x, f) for x, f in zip(leaves, fallback, strict=True)], finite


def mean_leaves(mean: jax.Array, bucket: Bucket) -> list[jax.Array]:
    """A bucket's flat ``mean`` cut into its leaves' shapes."""
    pieces = split_concatenated(mean, bucket)
    return [p.reshape(shape) for p, shape in zip(pieces, bucket.shapes, strict=True)]


def rank_major_pending(errors: Sequence[np.ndarray], bucket: Bucket) -> np.ndarray:
    """The summed reduce-scatter residuals of ``n`` devices (each ``(n * row,)`` in the
    rank-major layout of ``n`` rows), in the bucket's real coordinates (float64 ``(N,)``)."""
    n = len(errors)
    rows = [np.asarray(e, np.float64).reshape(n, -1) for e in errors]
    return sum(rank_major_to_concatenated(e, bucket, n, xp=np) for e in rows)


def rank_major_share(share: np.ndarray, bucket: Bucket, axis_size: int, length: int) -> np.ndarray:
    """``share`` (``(N,)``) as a reduce-scatter residual of ``length`` elements: ``axis_size``
    rank-major rows, flattened."""
    rows = concatenated_to_rank_major(share, bucket, axis_size, length // axis_size, xp=np)
    return rows.reshape(-1)
