"""DiLoCo and Streaming DiLoCo as an optax transformation, with compressed outer gradients.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105): every device trains its own copy of the parameters with an
``inner`` optimizer on its local gradients, without any communication, and every ``H`` steps
the devices average their *pseudo-gradients* (how far each moved away from the shared outer
parameters) and an ``outer`` optimizer moves the outer parameters with that average. Streaming
DiLoCo (Douillard et al., 2025, "Streaming DiLoCo with overlapping communication",
arXiv:2501.18512) syncs the parameters in ``F`` fragments at staggered steps (so the peak
bandwidth is that of one fragment), lets a fragment's reduction run for ``tau`` steps while
training continues, and quantizes the outer gradients. Here the reduction goes through
:func:`jaxcomm.compressed_pmean`, so any jaxcomm compressor (int8/int4 with error
feedback, 1-bit, top-k) carries the outer gradients, with its error feedback in the state.

The math, on device ``r`` of ``n``, with ``t = count + 1`` the 1-based step, ``theta`` the
outer (global) parameters (fp32, identical on every device) and ``x_r`` this device's local
parameters (the ``params`` the optimizer is applied to):

* every step: ``x_r <- x_r + inner.update(g_r, inner_state_r, x_r)`` (no communication);
* fragment ``f`` of ``F`` holds the leaves ``i`` with ``i % F == f`` (leaves in tree order:
  strided across layers, as the paper) and *syncs* after the steps ``t_s`` with
  ``t_s % H == o_f``, ``o_f = ((f + 1) H // F) % H`` (for ``F = 1``: every ``H``-th step);
* at a sync, ``Delta_f = C-mean_r(theta_f - x_{r,f})``: the outer gradient, the (compressed,
  error-fed-back) mean of the pseudo-gradients;
* ``tau`` steps later (``tau = overlap_steps``; at the sync step itself when ``tau = 0``):
  ``theta_f <- theta_f + outer.update(Delta_f, outer_state_f, theta_f)`` and
  ``x_{r,f} <- alpha x_{r,f} + (1 - alpha) theta_f``; the inner state is kept.

With ``F = 1, tau = 0, alpha = 0`` this is DiLoCo. With ``H = 1``, ``outer = optax.sgd(1.0)``
and ``inner = optax.sgd(lr)`` it is data-parallel SGD: ``theta - (theta - lr g_r)`` averaged is
``lr * mean_r g_r``.

Where the communication sits. With ``tau = 0`` the reduction of a fragment is in the program
of its sync step, after that step's inner update. With ``tau >= 1`` it is issued in the program
of step ``t_s + 1`` from that step's *input* parameters (``x_r`` after step ``t_s``); the result
waits in the state (``inflight``, checkpointable) and is merged at the end of step
``t_s + tau``. In one program the reduction holds the device until the wire is done (an XLA
runtime runs one program at a time per device, and a collective cannot outlive its program);
``background=True`` (``tau >= 2``, through ``jc.make_train_step``) takes it out of the step
programs: before step ``t_s + 1`` a device program of its own computes the pseudo-gradients
from that step's input state, and a host thread runs the compressed mean (device programs
around host-network exchanges) while the inner steps compute, merged at ``t_s + tau`` with the
same result (:mod:`jaxcomm.optim.diloco.background`).

Over a tuple of mesh axes, slowest first (``axis_name=("host", "local")`` on
``jax.make_mesh((nodes, devices_per_node), ("host", "local"))``, as MaxText's ``diloco`` axis),
the replicas ``r`` above are the *nodes*, the groups of the first (slow) axis: every inner step
uses the exact mean of the gradients over the trailing (fast) axes, plain data parallel inside a
node, so the devices of a node keep identical copies ``x_r``, and nothing crosses the slow link
between syncs. A sync reduces the pseudo-gradients with the two-level transport
(:mod:`jaxcomm.comm.two_level`): an exact reduce-scatter inside the node (of copies that are
already equal there, so it only cuts them into ``1/L`` shares), the compressor across the slow
axis on each device's share (``1/L`` of the outer gradient per device, with ``1/L`` of the
error feedback), an exact all-gather inside the node. A device whose gradient is not finite
makes its whole node skip that inner step. With ``background=True`` the exact steps inside the
node run in the sync's device programs and only the shares' compressed wires travel between
processes, across the slow axis (each of its positions on one process); compressors that
compress each leaf in its own shape (``jc.PowerSGD``) are refused over a tuple.

Parameters are **per device** (like :func:`jaxcomm.zero_one_adam`): :mod:`jaxcomm.train.layout`
stacks them ``(n, ...)`` with ``P(axis)`` because a :class:`DiLoCoState` is registered as
keeping per-device parameters. The model to evaluate is the outer one,
:func:`diloco_params` (``theta``); the local copies equal it right after a sync with
``alpha = 0`` (to one rounding of ``x + (theta - x)``; identical where they are within a factor
2 of each other, by Sterbenz's lemma).

Non-finite values: the state is kept and the skip counted. An inner step whose gradient is not
finite on a device (a NaN or an Inf) is skipped on that device: its parameters and inner state
are kept and its ``local.skips`` count it (no communication: the other devices step
on; the device's trajectory is that of a run in which it never saw those batches). A
non-finite outer gradient (an overflowing sum or 1-bit scale, the outer optimizer) skips the
fragment's sync: ``theta_f`` and its outer state are kept, the local copies are not merged and
train on, and ``skips`` counts it; the collective's own guard keeps the error feedback. An
inner update that overflows a local copy from a finite gradient (a diverging inner optimizer)
leaves that copy non-finite: its following steps are skipped as above and the syncs skipped,
until the streak check below stops the run (within ``max_consecutive_skips + 1 + sync_every``
steps). More than ``max_consecutive_skips`` outer steps in a row (``skips.consecutive``),
or a device still skipping at a sync after more than that many inner steps in a row
(``local.skips.consecutive``, compared at the syncs: one int32 max with the outer reduction), stop
the run with a ``FloatingPointError`` naming the limit (one host callback per step, as the
1-bit optimizers; ``None`` turns both off): a device whose copy has run away, or whose data
stays bad, does not train on silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm.comm.all_reduce import compressed_pmean
from jaxcomm.comm.axes import AxisName, canonical_axis, split_levels
from jaxcomm.comm.state import init_state
from jaxcomm.compressors import Compressor
from jaxcomm.guard import SkipCounters
from jaxcomm.optim._common import varying
from jaxcomm.optim._skip import all_finite, check_skips, keep_error_feedback
from jaxcomm.optim.diloco.background import BackgroundSpec, BackgroundUpdate
from jaxcomm.optim.diloco.programs import check_staged
from jaxcomm.optim.diloco.state import (
    DiLoCoLocal,
    DiLoCoState,
    check_compressor,
    check_int,
    fragment_leaves,
    fragment_offsets,
)
from jaxcomm.optim.diloco.steps import (
    axis_sizes_of,
    check_leaves,
    check_update,
    make_inner_step,
    make_outer_step,
    periodic,
)
from jaxcomm.optim.schedule import phase, phase_cond


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    axis_name: AxisName,
    compressor: Compressor | None = None,
    fragments: int = 1,
    overlap_steps: int = 0,
    alpha: float = 0.0,
    *,
    bucket_bytes: int | None = None,
    axis_size: int | tuple[int, ...] | None = None,
    max_consecutive_skips: int | None = 16,
    background: bool = False,
    sync_timeout: float = 300.0,
) -> optax.GradientTransformation:
    """DiLoCo / Streaming DiLoCo over local gradients (see the module docstring for the math).

    Args:
      inner: the local optimizer, applied every step to this device's gradients and parameters
        (the papers: ``optax.adamw(4e-4, weight_decay=0.1)``).
      outer: the optimizer of the outer parameters, whose gradient is the averaged
        pseudo-gradient ``theta - x`` (the papers: ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)``, also measured best with int4 outer gradients; with
        ``jc.SparseLoCo()``: ``optax.sgd(1.25)``, chosen over 0.7-1.5 in
        ``benchmarks/results/time_to_loss_select_outer_lr.json``). One outer state per
        fragment, over the fragment's list of leaves.
      sync_every: ``H``, steps between two syncs of a fragment (>= 1; the README's pick table
        measured ``H = 20``).
      axis_name: the data-parallel axis the outer gradients are averaged over, or a tuple of
        axes, slowest first (``("host", "local")``): the replicas are then the slow-axis
        groups, inner steps average the gradients exactly over the fast axes, and only the
        syncs send across the slow axis, compressed (see the module docstring).
      compressor: ``None`` (exact fp32 mean, one fused all-reduce) or a jaxcomm compressor,
        e.g. ``jc.Quantize(bits=4, error_feedback=True)``, ``jc.Quantize(bits=8,
        error_feedback=True)``, ``jc.OneBit()``, ``jc.TopK(0.01)``.
      fragments: ``F`` (1 <= F <= H and at most the number of leaves); > 1 is Streaming DiLoCo.
      overlap_steps: ``tau``, steps between a fragment's sync and the merge of its outer update
        (0 <= tau, and tau * F < H so that at most one fragment is in flight at a time).
      alpha: mixing of the local parameters at a merge, ``x <- alpha x + (1 - alpha) theta``
        (0 <= alpha <= 1; 0 replaces them, as DiLoCo).
      bucket_bytes: bucket size of the outer-gradient all-reduce (``None``: one bucket per
        fragment).
      axis_size: devices on the axis, for ``init`` outside the axis (default: the bound axis
        size, else ``jax.device_count()``); for a tuple of axes the tuple of their sizes,
        slowest first (default: the bound sizes).
      max_consecutive_skips: stop (``FloatingPointError``) once more than this many outer
        steps in a row were skipped as non-finite, or at a sync where a device has skipped more
        than this many inner steps in a row; ``None``: never (no host callback, no int32 max).
      background: run each sync's reduction on a host thread while the next ``tau - 1`` inner
        steps compute (``overlap_steps >= 2``; ``compressor`` ``None``, ``jc.Quantize``,
        ``jc.Cast`` or ``jc.OneBit``; through ``jc.make_train_step``, which drives it). Same
        parameters as ``background=False``; see :mod:`jaxcomm.optim.diloco.background`. Over a
        tuple of axes each position of the slow axis must lie on one process (the mesh
        ``jax.make_mesh((processes, local devices), ("host", "local"))``).
      sync_timeout: with ``background``, seconds a sync may take before the step that needs
        it raises ``SyncError`` (a process died or hung).

    Returns:
      An ``optax.GradientTransformation`` with a :class:`DiLoCoState`. ``update(grads, state,
      params)`` needs the local ``params`` and returns the change of the local parameters.
      Parameters are per device (:mod:`jaxcomm.train.layout` stacks them).

    Example (8 devices, e.g. ``JAX_NUM_CPU_DEVICES=8``)::

        import jax, jax.numpy as jnp, numpy as np, optax
        import jaxcomm as jc

        mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))

        def loss_fn(p, batch):
            x, y = batch
            return jnp.mean((x @ p["w"] - y) ** 2)

        tx = jc.diloco(optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True),
                       sync_every=10, axis_name="dp",
                       compressor=jc.Quantize(bits=4, error_feedback=True))
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, {"w": jnp.zeros((4, 1))})
        x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        for _ in range(30):  # 3 syncs
            state, loss = step(state, (x, x @ np.ones((4, 1), np.float32)))
        theta = jc.diloco_params(state.opt_state)  # the outer parameters: evaluate these
    """
    H = check_int("sync_every", sync_every, 1)
    F = check_int("fragments", fragments, 1)
    tau = check_int("overlap_steps", overlap_steps, 0)
    if F > H:
        raise ValueError(
            f"jaxcomm: diloco fragments={F} > sync_every={H}: fragments sync at distinct steps "
            "of each interval, so there can be at most sync_every of them"
        )
    if tau * F >= H:
        raise ValueError(
            f"jaxcomm: diloco overlap_steps={tau} must be < sync_every / fragments = {H}/{F} "
            "(a fragment's outer update has to land before the next fragment syncs)"
        )
    if isinstance(alpha, int | float) and not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"jaxcomm: diloco alpha must be in [0, 1], got {alpha!r}")
    compressor = check_compressor(compressor)
    axis_name = canonical_axis(axis_name)
    _, fast = split_levels(axis_name)
    if fast and not compressor.splits_into_shares:
        raise ValueError(
            f"jaxcomm: diloco over the tuple of axes {axis_name!r} exchanges 1-D shares of the "
            f"outer gradients across {axis_name[0]!r}, and {type(compressor).__name__} "
            "compresses each leaf in its own shape: use one axis, or another compressor"
        )
    if background:
        if tau < 2:
            raise ValueError(
                f"jaxcomm: diloco background=True needs overlap_steps >= 2 (got {tau}): the "
                "sync is issued at step t_s + 1 and merged at t_s + overlap_steps, so with 1 "
                "there is no step to hide it behind"
            )
        check_staged(compressor)
        if not (isinstance(sync_timeout, int | float) and sync_timeout > 0):
            raise ValueError(f"jaxcomm: diloco sync_timeout must be > 0 s, got {sync_timeout!r}")
    for name, tx in (("inner", inner), ("outer", outer)):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(
                f"jaxcomm: diloco {name} must be an optax GradientTransformation, got {tx!r}"
            )
    offsets = fragment_offsets(H, F)
    outer_step = make_outer_step(outer, alpha, axis_name)
    f32 = jnp.float32

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        check_leaves(leaves, F)
        n, sizes = axis_sizes_of(axis_name, axis_size)
        theta = jax.tree.map(lambda p: jnp.asarray(p, f32), params)
        theta_leaves = jax.tree.leaves(theta)
        groups = fragment_leaves(len(leaves), F)
        parts = [[theta_leaves[i] for i in ids] for ids in groups]
        return DiLoCoState(
            count=jnp.zeros([], jnp.int32),
            outer_params=theta,
            outer=tuple(outer.init(part) for part in parts),
            inflight=tuple([jnp.zeros_like(x) for x in part] for part in parts) if tau else (),
            skips=SkipCounters.zeros(),
            devices=jnp.zeros((n,), jnp.int8),
            local=DiLoCoLocal(
                inner.init(params),
                SkipCounters.zeros(),
                tuple([jnp.zeros_like(x) for x in part] for part in parts) if background else (),
            ),
            comm=tuple(
                init_state(compressor, part, axis_size=sizes, bucket_bytes=bucket_bytes)
                for part in parts
            ),
        )

    def reduce(delta, comm):
        carried = comm if jax.tree.leaves(comm) else None  # exact, or no error feedback
        mean, new = compressed_pmean(
            delta, carried, axis_name=axis_name, compressor=compressor, bucket_bytes=bucket_bytes
        )
        if carried is None:
            return mean, comm
        # A mean that is not finite skips its sync: every bucket keeps its error feedback.
        ok = all_finite(mean)
        return mean, keep_error_feedback(ok, new, comm, delta, compressor, bucket_bytes)

    inner_step = make_inner_step(inner, axis_name)

    def update_fn(updates, state, params=None):
        param_leaves, treedef = jax.tree.flatten(params)
        check_update(state, param_leaves, axis_name, F)
        if fast:
            # Over a tuple of axes a replica is a slow-axis group: its devices step together
            # on the exact mean of their gradients (plain data parallel inside a node).
            updates = lax.pmean(updates, fast)
        # Per device: a step whose gradient is not finite is not taken (make_inner_step).
        ok, inner_updates, inner_state = inner_step(
            updates, state.local.inner, params, jnp.ndim(state.local.skips.total) == 1
        )
        local = jax.tree.leaves(optax.apply_updates(params, inner_updates))
        inner_skips = state.local.skips.after(ok)
        theta = list(jax.tree.leaves(state.outer_params))
        t = state.count + 1
        outers, inflights, comms = list(state.outer), list(state.inflight), list(state.comm)
        outer_skips = state.skips
        # Leaves that no outer step can change this step (known at trace time in a
        # phase-specialised inner step): their update is the inner update itself.
        inner_only = [True] * len(param_leaves)
        for f, ids in enumerate(fragment_leaves(len(param_leaves), F)):
            th = [theta[i] for i in ids]
            x = varying([local[i] for i in ids], axis_name)
            if tau == 0:

                def sync(th, x, outer_state, comm, skips):
                    delta = [a - b.astype(f32) for a, b in zip(th, x, strict=True)]
                    delta, comm = reduce(delta, comm)
                    th, outer_state, x, skips = outer_step(delta, th, outer_state, x, skips)
                    return th, x, outer_state, comm, skips

                def keep(th, x, outer_state, comm, skips):
                    return th, x, outer_state, comm, skips

                value, steady = periodic(t, H, offsets[f], 0)
                synced = phase(value, steady=steady)
                th, x, outers[f], comms[f], outer_skips = phase_cond(
                    synced, sync, keep, th, x, outers[f], comms[f], outer_skips
                )
            else:
                # With background=True, the host side (diloco.background) computes this
                # fragment's pseudo-gradients into the state's pending slot from the input
                # state of step t_s + 1 and reduces them meanwhile: the steps pass them on.
                if not background:
                    prev = [jnp.asarray(param_leaves[i], f32) for i in ids]  # x_r, step t_s
                    issued = periodic(t, H, offsets[f], 1)

                    def issue(th, prev, pending, comm):
                        delta = [a - b for a, b in zip(th, prev, strict=True)]
                        return reduce(delta, comm)

                    def wait(th, prev, pending, comm):
                        return pending, comm

                    inflights[f], comms[f] = phase_cond(
                        phase(issued[0], steady=issued[1]),
                        issue,
                        wait,
                        th,
                        prev,
                        inflights[f],
                        comms[f],
                    )

                def hold(pending, th, outer_state, x, skips):
                    return th, outer_state, x, skips

                merged = periodic(t, H, offsets[f], tau)
                synced = phase(merged[0], steady=merged[1])
                th, outers[f], x, outer_skips = phase_cond(
                    synced, outer_step, hold, inflights[f], th, outers[f], x, outer_skips
                )
            for i, a, b in zip(ids, th, x, strict=True):
                theta[i], local[i] = a, b
                inner_only[i] = synced is False
        inner_leaves = jax.tree.leaves(inner_updates)

        def update_of(i, new, p):
            if inner_only[i] and jnp.result_type(inner_leaves[i]) == jnp.result_type(p):
                # p + u itself, not p + ((p + u) - p): exact, and the update does not read p
                # (XLA then writes the per-device parameters in place instead of copying them).
                return inner_leaves[i]  # zeros on a skipped step
            return (new.astype(f32) - jnp.asarray(p, f32)).astype(jnp.result_type(p))

        new_updates = treedef.unflatten(
            [update_of(i, x, p) for i, (x, p) in enumerate(zip(local, param_leaves, strict=True))]
        )
        new_state = DiLoCoState(
            count=t,
            outer_params=jax.tree.unflatten(jax.tree.structure(state.outer_params), theta),
            outer=tuple(outers),
            inflight=tuple(inflights),
            skips=outer_skips,
            devices=state.devices,
            local=DiLoCoLocal(inner_state, inner_skips, state.local.pending),
            comm=tuple(comms),
        )
        if max_consecutive_skips is not None:
            # Devices do not talk between syncs, and a check that fails on one device only
            # would leave the others waiting in the next collective: the inner streaks are
            # compared at the steps that communicate anyway (one int32 max), so a device that
            # keeps failing stops the run at the next sync.
            talks = [periodic(t, H, o, 0 if tau == 0 else 1) for o in offsets]
            values = jnp.stack([v for v, _ in talks])
            steady = jnp.where(jnp.any(values), 0, jnp.min(jnp.stack([s for _, s in talks])))
            worst = phase_cond(
                phase(jnp.any(values), steady=steady),
                lambda x: lax.pmax(x, axis_name),
                lambda x: jnp.zeros([], jnp.int32),
                inner_skips.consecutive.reshape(()),
            )
            worst = jnp.maximum(worst, outer_skips.consecutive)
            check_skips(worst, max_consecutive_skips, "diloco")
        return new_updates, new_state

    if not background:
        return optax.GradientTransformation(init_fn, update_fn)
    # The update carries its sync's spec; jc.make_train_step attaches the BackgroundSync (the
    # thread and the host links) that runs it, visible as step.background.
    spec = BackgroundSpec(compressor, axis_name, bucket_bytes, H, F, tau, float(sync_timeout))
    return optax.GradientTransformation(init_fn, BackgroundUpdate(update_fn, spec))
