"""``CommBackend``: DeepSpeed's communication-backend interface over jaxcomm collectives.

DeepSpeed's ``CommBackend`` hides the transport (NCCL, MPI, ...) behind ``all_reduce(tensor,
op)`` and friends, and its compressed backend adds 1-bit all-reduce and coalesced reduce-scatter.
In JAX the transport is XLA's, chosen by the platform and :func:`jaxcomm.init_distributed`; what
remains is *how* a tree is reduced over a mesh axis, which is what this class configures once::

    backend = jc.CommBackend(jc.CommConfig(axis_name="dp", compressor=jc.OneBit()))
    state = backend.init_state(local_grads, axis_size=8)
    # inside shard_map / pmap:
    grads, state = backend.all_reduce(grads, state, op=jc.ReduceOp.AVG)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import jax
from jax import lax

from jaxcomm._compat import bound_axis_size
from jaxcomm.comm.all_reduce import compressed_pmean, compressed_psum
from jaxcomm.comm.scatter_gather import compressed_all_gather, compressed_pmean_scatter
from jaxcomm.comm.state import StateOp, init_state
from jaxcomm.compressors import Compressor, NoCompression
from jaxcomm.compressors.buckets import flatten_bucket, map_buckets, plan_buckets, unflatten_bucket

PyTree = Any


class ReduceOp(enum.Enum):
    """Reduction of :meth:`CommBackend.all_reduce` (``torch.distributed.ReduceOp`` names)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class CommConfig:
    """What a :class:`CommBackend` reduces over and how.

    Attributes:
      axis_name: the mesh or pmap axis reduced over (the data-parallel axis).
      compressor: how floating buckets are compressed (``NoCompression()`` is exact).
      bucket_bytes: bucket size for fusion; ``None`` fuses each dtype into one bucket.
      axis_size: devices on the axis, for :meth:`CommBackend.init_state` outside a mapped
        context; ``None`` means ``jax.device_count()``.
    """

    axis_name: str
    compressor: Compressor = field(default_factory=NoCompression)
    bucket_bytes: int | None = None
    axis_size: int | None = None


class CommBackend:
    """DeepSpeed-style backend: compressed, coalesced collectives with one configuration."""

    def __init__(self, config: CommConfig):
        if not isinstance(config, CommConfig):
            raise TypeError(f"jaxcomm: CommBackend takes a CommConfig, got {config!r}")
        self.config = config

    def __repr__(self) -> str:
        return f"CommBackend({self.config!r})"

    def init_state(
        self, tree: PyTree, *, axis_size: int | None = None, op: StateOp = "all_reduce"
    ) -> Any:
        """One device's error-feedback state for ``tree`` (see :func:`jaxcomm.init_state`)."""
        size = axis_size or self.config.axis_size or jax.device_count()
        return init_state(
            self.config.compressor,
            tree,
            axis_size=size,
            bucket_bytes=self.config.bucket_bytes,
            op=op,
        )

    def world_size(self) -> int:
        """Size of the configured axis; only where it is bound."""
        return bound_axis_size(self.config.axis_name)

    def all_reduce(
        self, tree: PyTree, state: Any, op: ReduceOp = ReduceOp.SUM
    ) -> tuple[PyTree, Any]:
        """Reduce ``tree`` over the axis. SUM and AVG are compressed; MAX and MIN are exact.

        MAX and MIN cannot be computed from compressed payloads, so they are refused with a
        lossy compressor rather than silently computed exactly behind the user's back.
        """
        op = ReduceOp(op)
        cfg = self.config
        kwargs = dict(axis_name=cfg.axis_name, compressor=cfg.compressor)
        if op is ReduceOp.SUM:
            return compressed_psum(tree, state, bucket_bytes=cfg.bucket_bytes, **kwargs)
        if op is ReduceOp.AVG:
            return compressed_pmean(tree, state, bucket_bytes=cfg.bucket_bytes, **kwargs)
        if cfg.compressor.lossy:
            raise ValueError(
                f"jaxcomm: ReduceOp.{op.name} cannot be compressed; compressor "
                f"{cfg.compressor!r} supports SUM and AVG only. Use a CommBackend with "
                "NoCompression() for MAX/MIN."
            )
        return _exact_extremum(tree, cfg.axis_name, cfg.bucket_bytes, op), state

    def reduce_scatter_coalesced(self, tensors: PyTree, state: Any) -> tuple[PyTree, Any]:
        """DeepSpeed's ``reduce_scatter_coalesced``: this device's slice of every leaf's mean.

        ``state`` comes from ``init_state(tree, op="reduce_scatter")``.
        """
        cfg = self.config
        return compressed_pmean_scatter(
            tensors,
            state,
            axis_name=cfg.axis_name,
            compressor=cfg.compressor,
            bucket_bytes=cfg.bucket_bytes,
        )

    def all_gather(self, shards: PyTree, state: Any = None, *, like: PyTree) -> tuple[PyTree, Any]:
        """Inverse of :meth:`reduce_scatter_coalesced`: full leaves shaped like ``like``."""
        cfg = self.config
        return compressed_all_gather(
            shards,
            state,
            axis_name=cfg.axis_name,
            compressor=cfg.compressor,
            like=like,
            bucket_bytes=cfg.bucket_bytes,
        )


def _exact_extremum(tree: PyTree, axis_name: str, bucket_bytes: int | None, op: ReduceOp):
    """Fused ``lax.pmax`` / ``lax.pmin``: one collective per dtype bucket."""
    bound_axis_size(axis_name)
    reduce = lax.pmax if op is ReduceOp.MAX else lax.pmin
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    buckets = plan_buckets(leaves, bucket_bytes, NoCompression().compute_dtype)

    def one_bucket(bucket):
        flat = flatten_bucket(leaves, bucket)
        if bucket.numel:
            flat = reduce(flat, axis_name)
        return unflatten_bucket(flat, bucket), None

    out, _ = map_buckets(one_bucket, buckets, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, out)
