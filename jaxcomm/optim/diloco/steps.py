"""DiLoCo's steps: the inner step on one device's copy, and the outer step at a merge.

:func:`make_inner_step` runs the inner optimizer on one device's copy. A step whose gradient is
not finite on a device is not taken there: its parameters and inner state are kept (the update
is zero). The check reads the gradient before the inner update, so the update runs inside a
``lax.cond`` whose taken branch updates the donated state in place; checking the new copy
instead would need a second pass of selects over the state after the update, and copies of it.

:func:`make_outer_step` applies a fragment's reduced outer gradient ``Delta_f`` to the outer
parameters, ``theta_f <- theta_f + outer.update(Delta_f, outer_state_f, theta_f)``, and mixes
the local copies, ``x_f <- alpha x_f + (1 - alpha) theta_f``; a non-finite ``Delta_f`` or new
``theta_f`` skips the merge (all kept) and counts it. :func:`periodic` is the schedule predicate
of the syncs with the number of steps it is sure to hold (a phase's ``steady``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.comm.axes import AxisName
from jaxcomm.fusion import apart_on_cpu, written_once
from jaxcomm.guard import SkipCounters, keep_if
from jaxcomm.optim._common import resolve_axis_size, varying
from jaxcomm.optim._skip import all_finite
from jaxcomm.optim.diloco.state import DiLoCoState, check_int
from jaxcomm.optim.schedule import STEADY_FOREVER


def axis_sizes_of(axis_name, axis_size) -> tuple[int, int | tuple[int, ...]]:
    """``(devices, axis_size for jc.init_state)``: ``axis_size`` if given, else the bound
    axis's size (for a tuple of axes, the product of their sizes and the tuple of them, slowest
    first), else, for one unbound axis, ``jax.device_count()``."""
    if isinstance(axis_name, str) and axis_size is not None:
        axis_size = check_int("axis_size", axis_size, 1)
    sizes = resolve_axis_size(axis_name, axis_size)
    if isinstance(sizes, tuple):
        return math.prod(sizes), sizes
    return sizes, sizes


def check_leaves(leaves: Sequence, fragments: int) -> None:
    """Floating leaves only, and at least one per fragment."""
    for leaf in leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"jaxcomm: diloco trains floating parameters only, got a leaf of dtype "
                f"{jnp.result_type(leaf)} (keep integer/bool state outside the optimized tree)"
            )
    if fragments > len(leaves):
        raise ValueError(
            f"jaxcomm: diloco fragments={fragments} but the parameters have only {len(leaves)} "
            f"leaves (fragments are sets of whole leaves, leaf i in fragment i % fragments): "
            f"use fragments <= {len(leaves)}"
        )


def check_update(state, param_leaves: Sequence, axis_name, fragments: int) -> None:
    """Refuse, at trace time, an update without parameters, state or bound axis, or whose
    state was built for another device count."""
    if param_leaves is None or not param_leaves:
        raise ValueError(
            "jaxcomm: diloco needs the local parameters: call update(grads, state, params)"
        )
    if not isinstance(state, DiLoCoState):
        raise TypeError(f"jaxcomm: diloco got a state of type {type(state).__name__}")
    check_leaves(param_leaves, fragments)
    try:
        bound = int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"jaxcomm: diloco's axis {axis_name!r} is not bound here: call update inside "
            f"jax.shard_map / jax.pmap over {axis_name!r} (e.g. via jc.make_train_step)"
        ) from err
    if state.devices.shape[0] != bound:
        raise ValueError(
            f"jaxcomm: this DiLoCo state was built for {state.devices.shape[0]} devices but "
            f"axis {axis_name!r} has {bound}: convert it with jc.resize_diloco_state"
        )


def periodic(t, period: int, offset: int, delay: int):
    """``((t - delay) % period == offset) & (t - delay >= 1)`` and its ``steady``: for how many
    following steps (``t`` growing by one a step) it is sure to keep its value."""
    s = jnp.asarray(t, jnp.int32) - delay
    value = (s % period == offset) & (s >= 1)
    # Steps to the next s' > s with s' % period == offset and s' >= 1.
    ahead = (offset - s) % period
    ahead = jnp.where(ahead == 0, period, ahead)
    first = jnp.where(offset >= 1, offset, period)  # the first s' >= 1 on the schedule
    ahead = jnp.where(s + ahead < 1, first - s, ahead)
    steady = jnp.where(value, 0, ahead - 1).astype(jnp.int32)
    return value, jnp.minimum(steady, STEADY_FOREVER)


def make_outer_step(outer: optax.GradientTransformation, alpha, axis_name: AxisName):
    """``outer_step(delta, theta, outer_state, local, skips) -> (theta, outer_state, local,
    skips)`` over a fragment's lists of leaves (``skips``: the state's outer
    :class:`~jaxcomm.guard.SkipCounters`)."""
    static_alpha_zero = isinstance(alpha, int | float) and float(alpha) == 0.0
    f32 = jnp.float32

    def outer_step(delta, theta, outer_state, local, skips: SkipCounters):
        updates, _ = outer.update(delta, outer_state, theta)
        new_theta = optax.apply_updates(theta, updates)
        # The new outer state from its own copy of the inputs (on CPU): each of the two fuses
        # into the select that keeps it, instead of both being written and read back.
        _, new_outer = outer.update(*apart_on_cpu(delta, outer_state, theta))
        # The probe recomputes the new anchor from its inputs behind a barrier (on GPU): else
        # XLA:GPU writes it for the probe and reads it back in the selects (H100 program:
        # -1 pass of the parameters).
        d_, th_, st_ = written_once(delta, theta, outer_state)
        finite = all_finite(d_, optax.apply_updates(th_, outer.update(d_, st_, th_)[0]))
        new_theta = keep_if(finite, new_theta, theta)
        new_outer = keep_if(finite, new_outer, outer_state)
        if static_alpha_zero:
            merged = [th.astype(x.dtype) for th, x in zip(new_theta, local, strict=True)]
        else:
            a = jnp.asarray(alpha, f32)
            merged = [
                (a * x.astype(f32) + (1 - a) * th).astype(x.dtype)
                for th, x in zip(new_theta, local, strict=True)
            ]
        merged = keep_if(finite, merged, local)
        merged = [ensure_varying(x, axis_name) for x in merged]
        return new_theta, new_outer, merged, skips.after(finite)

    return outer_step


def make_inner_step(
    inner: optax.GradientTransformation, axis_name: AxisName, keep_by: str | None = None
) -> Callable:
    """``inner_step(updates, inner_state, params, blocked) -> (ok, inner_updates, inner_state)``.

    ``ok``: this device's gradient is finite (:func:`all_finite`); when it is
    not, ``inner_updates`` are zeros and ``inner_state`` the input's. ``blocked``: the inner
    state's leaves are the ``(1, ...)`` blocks of ``jc.local_view`` (the inner optimizer then
    runs under ``vmap`` over that axis, so it sees its usual shapes and XLA updates its donated
    state in place).

    ``keep_by``: how a skipped step keeps the state, the same values either way. ``"cond"``: the
    update runs in a ``lax.cond`` (XLA:CPU writes the taken branch's state in place); ``"select"``:
    the update runs and a select keeps the old state (XLA:GPU fuses the select into the update,
    but copies a conditional's operands and results: the whole state, twice; see the DiLoCo
    inner rows of ``benchmarks/results/bytes_accessed_h100.json``). ``None``: ``"cond"`` on CPU,
    ``"select"`` elsewhere.
    """
    if keep_by not in (None, "cond", "select"):
        raise ValueError(f"jaxcomm: keep_by is 'cond', 'select' or None, got {keep_by!r}")

    def inner_step(updates, inner_state, params, blocked: bool):
        def take(updates, inner_state, params):
            if blocked:

                def block(tree):
                    return jax.tree.map(lambda x: jnp.reshape(x, (1, *jnp.shape(x))), tree)

                new_updates, new_state = jax.vmap(inner.update)(
                    block(updates), inner_state, block(params)
                )
                new_updates = jax.tree.map(lambda u: u[0], new_updates)
            else:
                new_updates, new_state = inner.update(updates, inner_state, params)
            return varying((new_updates, new_state), axis_name)  # both branches typed alike

        def skip(updates, inner_state, params):
            shapes = jax.eval_shape(take, updates, inner_state, params)[0]
            # The gradient itself stands in for the zeros where it can (masked below): zeros
            # made here are a constant that XLA hoists out of the conditional and copies into
            # its operands on every step, a write of every leaf.
            stand_in = jax.tree.map(
                lambda u, s: (
                    u if (u.shape, u.dtype) == (s.shape, s.dtype) else jnp.zeros(s.shape, s.dtype)
                ),
                updates,
                shapes,
            )
            return varying((stand_in, inner_state), axis_name)

        def selected(ok, updates, inner_state, params):
            new_updates, new_state = take(updates, inner_state, params)
            old = varying(inner_state, axis_name)
            return new_updates, keep_if(ok, new_state, old)

        def conditional(ok, updates, inner_state, params):
            return lax.cond(ok, take, skip, updates, inner_state, params)

        ok = all_finite(updates)
        if keep_by is None:
            new_updates, new_state = lax.platform_dependent(
                ok, updates, inner_state, params, cpu=conditional, default=selected
            )
        else:
            run = conditional if keep_by == "cond" else selected
            new_updates, new_state = run(ok, updates, inner_state, params)
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        return ok, new_updates, new_state

    return inner_step
