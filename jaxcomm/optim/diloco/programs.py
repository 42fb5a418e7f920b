"""The device programs of one fragment's background DiLoCo sync.

:mod:`jaxcomm.optim.diloco.background` runs a sync as device programs around host exchanges
(:mod:`jaxcomm.runtime.host_links`): the transport of the staged codec's exchanges is the
host network. The programs run the compressor's stages (:mod:`jaxcomm.compressors.staged`, the
arithmetic the in-program all-reduce runs), one bucket at a time; each program is a
``shard_map`` over the data axis, compiled on first use:

* ``issue(theta, params, comm)``: before step ``t_s + 1``, each device's pseudo-gradient
  ``theta_f - x_f`` (fp32, as the single-program step takes it) and the worker stage on it;
* ``worker(pending, comm)``: the worker stage from a stored pseudo-gradient (a sync reissued
  from a restored state);
* ``server(received, kept)``: the server stage;
* ``finish(gathered, workers, servers, kept)``: the decoding with the non-finite guard's
  verdict, and the error feedback it settles.

Over a tuple of axes, slowest first (``("host", "local")``), the programs are the in-program
two-level transport's (:mod:`jaxcomm.comm.two_level`) cut at its slow-axis exchanges: ``issue``
and ``worker`` reduce-scatter each bucket exactly over the fast axes (device ``(s, l)`` keeps
share ``l`` of its node's mean) and run the worker stage on that share for the ``S`` positions
of the slow axis; ``server`` is unchanged; ``finish`` decodes the share from the wires gathered
across the slow axis (one set per fast position, split over the fast axes) and all-gathers the
shares exactly over the fast axes. Only the share's wires leave the device programs.

Only what the later stages read of the old state is copied at the worker stage (the server
residuals, the non-finite count and the worker payloads' finiteness probes: the next step
donates the state); the old worker residuals stay in the state, where the host finds them when
the guard keeps them. With more than one bucket, any bucket whose mean is not finite skips the
whole sync: every bucket keeps its error feedback (DiLoCo's skipped sync).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm.axes import split_levels
from jaxcomm.comm.state import ReduceState, plan_tree
from jaxcomm.comm.two_level import gather_shares, scatter_share
from jaxcomm.compressors import (
    Compressor,
    StagedCodec,
    TwoStageState,
    finish_stage,
    guarded_finish,
    server_stage,
    worker_stage,
)
from jaxcomm.compressors.buckets import Bucket, ceil_div, flatten_bucket, unflatten_bucket
from jaxcomm.optim._skip import all_finite


def check_staged(compressor: Compressor | None) -> None:
    """Refuse, with the fix, a compressor whose all-reduce has no stages to run around host
    exchanges."""
    if compressor is None or compressor.staged_codec() is not None:
        return
    raise ValueError(
        f"jaxcomm: diloco(background=True) runs the outer gradient's reduction as device "
        f"programs around host exchanges, which needs a staged codec (compressor=None, "
        f"jc.Quantize, jc.Cast, jc.OneBit); got {compressor!r}: use one of these, or "
        "background=False"
    )


class Plan(NamedTuple):
    """Static layout of one fragment's reduction: its codec, buckets and chunk layouts."""

    codec: StagedCodec
    buckets: tuple[Bucket, ...]
    layouts: tuple[tuple[int, int], ...]  # (blocks B, length L) of each bucket's chunk
    fast: tuple[str, ...] = ()  # the fast axes of a tuple (exact), () over one axis
    fast_size: int = 1

    @property
    def guarded(self) -> bool:
        """Error feedback: the residuals go through the non-finite guard."""
        return self.codec.error_feedback

    def share_numel(self, bucket: Bucket) -> int:
        """What the slow axis's stages reduce of ``bucket``: all of it over one axis, one fast
        device's ``ceil(N / L)`` share over a tuple."""
        return ceil_div(bucket.numel, self.fast_size)


def plan(compressor: Compressor, leaves, bucket_bytes, axis_size: int, fast=(), fast_size=1):
    """``axis_size``: the positions the stages run over (the slow axis's over a tuple)."""
    _, _, buckets = plan_tree(list(leaves), compressor, bucket_bytes)
    codec = compressor.staged_codec()
    layouts = tuple(
        codec.chunk_layout(ceil_div(ceil_div(b.numel, fast_size), axis_size)) for b in buckets
    )
    return Plan(codec, tuple(buckets), layouts, tuple(fast), fast_size)


def worker(p: Plan, leaves, comm: ReduceState, n: int):
    """The worker stage on one device: ``(wires, worker residuals, probes)``; ``wires[k]`` is
    bucket ``k``'s tuple of ``(n, ...)`` arrays, row ``q`` for device ``q``."""
    outs = [
        worker_stage(
            p.codec,
            share(p, flatten_bucket(leaves, bucket)),
            comm.buckets[k].worker_error if p.guarded else None,
            layout,
            n,
        )
        for k, (bucket, layout) in enumerate(zip(p.buckets, p.layouts, strict=True))
    ]
    return [o.wire for o in outs], [o.error for o in outs], [o.probe for o in outs]


def share(p: Plan, flat: jax.Array) -> jax.Array:
    """Over a tuple: this device's share of the exact mean over the fast axes (the in-program
    two-level transport's first step); over one axis, ``flat`` itself."""
    return scatter_share(flat, p.fast, p.fast_size, True) if p.fast else flat


def kept(p: Plan, comm: ReduceState, probes):
    """What the server and finish stages read of the old state, copied (the next step donates
    it): each bucket's server residual, the non-finite count, and the worker probes (``()``
    without error feedback)."""
    if not p.guarded:
        return ()
    return [jnp.copy(b.server_error) for b in comm.buckets], jnp.copy(comm.nonfinite), probes


def server(p: Plan, received, kept):
    """The server stage on one device: ``(wires to gather, [(server residual, whether the
    received wires were finite)])``."""
    outs = [
        server_stage(p.codec, received[k], kept[0][k] if p.guarded else None, layout)
        for k, layout in enumerate(p.layouts)
    ]
    return [o.wire for o in outs], [(o.error, o.received_ok) for o in outs]


def finish(p: Plan, gathered, workers, servers, kept, n: int):
    """The decoding on every device: ``(the mean's leaves in fragment order, flags)``;
    ``flags``: ``()`` without error feedback, else ``(keep_old, count, server residuals)``:
    whether this device keeps its old residuals, the non-finite count after the sync, and the
    server residuals as the guard settles them. Over a tuple the guard is the share's (as in
    one program), and with several buckets a mean that is not finite anywhere keeps every
    bucket's residuals (DiLoCo's skipped sync, decided on the gathered mean)."""
    out: list = [None] * sum(len(b.leaf_ids) for b in p.buckets)
    any_bad, keep_old, settled = jnp.bool_(False), None, []
    for k, (bucket, layout) in enumerate(zip(p.buckets, p.layouts, strict=True)):
        numel = p.share_numel(bucket)
        if p.guarded:
            new_server, received_ok = servers[k]
            new = TwoStageState(workers[k], new_server)
            mean, finite = guarded_finish(p.codec, kept[2][k], gathered[k], numel, layout, n, new)
            # The worker residual is the host's to keep (it holds the old one in the state).
            settled.append(p.codec.settle_server_error(finite, received_ok, new_server, kept[0][k]))
            keep_old = p.codec.keeps_old_worker_error(finite, received_ok)
            any_bad = any_bad | ~finite
        else:
            mean = finish_stage(p.codec, gathered[k], numel, n)
        if p.fast:
            mean = gather_shares(mean, p.fast, bucket.numel)
        for i, leaf, dtype in zip(
            bucket.leaf_ids, unflatten_bucket(mean, bucket), bucket.dtypes, strict=True
        ):
            out[i] = leaf.astype(dtype)
    if not p.guarded:
        return out, ()
    if len(p.buckets) > 1:
        keep_old = ~all_finite(out) if p.fast else any_bad
    return out, (keep_old, kept[1] + any_bad.astype(jnp.int32), settled)


class FragmentPrograms:
    """The stage programs of one fragment's sync (see the module docstring)."""

    def __init__(self, compressor: Compressor, axis_name, bucket_bytes, mesh, leaves) -> None:
        slow, fast = split_levels(axis_name)
        n = int(mesh.shape[slow])  # the positions the stages run over
        fast_size = math.prod(int(mesh.shape[a]) for a in fast)
        self.plan = p = plan(compressor, leaves, bucket_bytes, n, fast, fast_size)
        per, rep = P(axis_name), P()
        # The wires gathered across the slow axis: the same on every device over one axis;
        # over a tuple one set per fast position, (L, S, ...) split over the fast axes.
        gather = P(fast) if fast else rep

        def local(tree):
            return jax.tree.map(lambda x: x[0], tree)

        def block(tree):
            return jax.tree.map(lambda x: x[None], tree)

        def run_worker(pending, comm):
            wires, residuals, probes = worker(p, local(pending), local(comm), n)
            return block(wires), block(residuals), block(kept(p, local(comm), probes))

        def issue(theta, params, comm):
            pending = [
                a - jnp.asarray(x, jnp.float32) for a, x in zip(theta, local(params), strict=True)
            ]
            return (block(pending), *run_worker(block(pending), comm))

        def run_server(received, kept):
            return block(server(p, local(received), local(kept)))

        def run_finish(gathered, workers, servers, kept):
            gathered = local(gathered) if fast else gathered
            mean, flags = finish(p, gathered, local(workers), local(servers), local(kept), n)
            return mean, block(flags)

        def program(fn, in_specs, out_specs):
            mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            return jax.jit(mapped)

        self.issue = program(issue, (rep, per, per), (per, per, per, per))
        self.worker = program(run_worker, (per, per), (per, per, per))
        self.server = program(run_server, (per, per), (per, per))
        self.finish = program(run_finish, (gather, per, per, per), (rep, per))
        self._per = NamedSharding(mesh, per)
        self.gathered = NamedSharding(mesh, gather)
        self.slow_size, self.fast_size = n, fast_size

    def gathered_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape ``finish`` takes for a server wire whose per-device rows stack to
        ``shape`` (``(S L, ...)``): ``(S, ...)`` over one axis, ``(L, S, ...)`` over a tuple."""
        if not self.plan.fast:
            return shape
        return (self.fast_size, self.slow_size, *shape[1:])

    def compile_all(self, theta, params, comm) -> None:
        """Compiles the four programs before the sync first runs them, from the arguments
        ``issue`` will take (arrays, or ``jax.ShapeDtypeStruct`` leaves with their shardings):
        ``issue`` and ``worker`` (a resumed sync) with those, ``server`` and ``finish`` with
        the wires the host exchanges hand them (split over the data axes, and gathered)."""

        def placed(tree, sharding=None):
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None)
                ),
                tree,
            )

        theta, params, comm = placed(theta), placed(params), placed(comm)
        self.issue.lower(theta, params, comm).compile()
        pending, wires, workers, kept = placed(
            jax.eval_shape(self.issue, theta, params, comm), self._per
        )
        self.worker.lower(pending, comm).compile()
        received = placed(wires, self._per)
        self.server.lower(received, kept).compile()
        gathered, servers = jax.eval_shape(self.server, received, kept)
        gathered = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(self.gathered_shape(x.shape), x.dtype), gathered
        )
        self.finish.lower(
            placed(gathered, self.gathered), workers, placed(servers, self._per), kept
        ).compile()
