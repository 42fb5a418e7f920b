"""Skipping a non-finite step, shared by the optimizers of :mod:`jaxcomm.optim`.

A step whose gradients, mean or update hold a NaN or an Inf on any device changes nothing on
every device: the state is kept (the collectives' guard keeps each bucket's error feedback;
:func:`keep_error_feedback` keeps all of them), the update is zero, the state's
:class:`~jaxcomm.guard.SkipCounters` count the steps skipped in a row and in all, and more
than ``max_consecutive_skips`` in a row raise (:func:`check_skips`). The policy itself (the
finiteness test, keep-or-skip, the counters) is :mod:`jaxcomm.guard`'s; this module applies
it to the optimizers' states.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.comm.state import ReduceState, plan_tree
from jaxcomm.compressors import Compressor
from jaxcomm.guard import SkipCounters, host_skip_caps, keep_if, probes_finite, too_many_skips
from jaxcomm.optim.schedule import recording_phases

PyTree = Any


def all_finite(*trees: PyTree) -> jax.Array:
    """One bool scalar: no leaf holds a NaN or an Inf (exact: finite values whose sum would
    overflow are finite): :func:`~jaxcomm.guard.probes_finite` over every floating leaf;
    replicated when the trees are."""
    return probes_finite([x for t in trees for x in jax.tree.leaves(t)])


def mean_finite(
    mean: PyTree,
    old_comm: PyTree,
    new_comm: PyTree,
    axis_name: str,
    *,
    replicated: bool = True,
    compressor: Compressor | None = None,
) -> jax.Array:
    """Whether a ``compressed_pmean`` result ``mean`` is finite (a bool scalar).

    Read from the collectives' guard when the state counts non-finite calls (``nonfinite``
    unchanged on every device: no pass over the mean; the guard decides from the few values it
    already has, e.g. OneBit's scales, of which every output element is one times a sign), else
    :func:`all_finite` of ``mean``. ``replicated``: typed as replicated (one int32 ``pmin``);
    ``False`` for a caller that takes its own ``pmin`` of the flag (the result is then typed as
    varying, with the same value on every device). A ``compressor`` whose guarded output is
    NaN or finite as a whole (``output_decides_finite``, OneBit) and an fp32 ``mean``: the
    first element of each leaf decides, replicated as the mean is, with no ``pmin`` (a
    collective's fixed cost).
    """
    leaves = [x for x in jax.tree_util.tree_leaves(mean) if x.size]
    if (
        replicated
        and getattr(compressor, "output_decides_finite", False)
        and all(x.dtype == jnp.float32 for x in leaves)
    ):
        return jnp.all(jnp.stack([jnp.isfinite(x.reshape(-1)[0]) for x in leaves] or [True]))
    counter = getattr(new_comm, "nonfinite", ())
    if not jax.tree_util.tree_leaves(counter):
        finite = all_finite(mean)
        return finite if replicated else ensure_varying(finite, axis_name)
    same = ensure_varying(jnp.all(counter == old_comm.nonfinite), axis_name)
    if not replicated:
        return same
    return lax.pmin(same.astype(jnp.int32), axis_name) > 0


def check_skips(skipped: jax.Array, limit: int | None, name: str) -> None:
    """Raise (``FloatingPointError``) once ``skipped`` consecutive non-finite steps exceed
    ``limit`` (``None``: never, and no check at all).

    In the program by default: a ``jax.debug.callback`` in a conditional, raising at run time
    inside a ``JaxRuntimeError``. A step traced under :func:`jaxcomm.guard.skip_caps_on_host`
    (``jc.make_train_step`` on GPU) takes the streak and the cap out of the program instead,
    and the host raises once that step is done."""
    if limit is None or recording_phases():  # the probe of a phased step has no effects
        return
    host = host_skip_caps()
    if host is not None and host.take(skipped, limit, name):
        return

    def check(n, cap):
        n, cap = int(np.max(np.asarray(n))), int(np.min(np.asarray(cap)))
        if n > cap:
            raise too_many_skips(name, n, cap)

    # In a cond the callback costs nothing until it is due; the host checks again (under vmap a
    # cond on a batched predicate runs both branches). The limit is an argument, not a closure:
    # optax.inject_hyperparams traces it.
    def due(n, cap):
        jax.debug.callback(check, n, cap)

    jax.lax.cond(jnp.any(skipped > limit), due, lambda n, cap: None, skipped, limit)


def on_every_device(ok: jax.Array, axis_name: str) -> jax.Array:
    """``ok`` on every device of the axis (one int32 ``pmin``), typed as replicated."""
    return lax.pmin(ensure_varying(ok.astype(jnp.int32), axis_name), axis_name) > 0


def count_skips(ok: jax.Array, skips: SkipCounters, limit: int | None, name: str) -> SkipCounters:
    """The counters after this step (applied where ``ok``), raising past ``limit`` in a row."""
    new = skips.after(ok)
    check_skips(new.consecutive, limit, name)
    return new


def zeros_unless(ok: jax.Array, tree: PyTree) -> PyTree:
    """``tree`` where ``ok``, else zeros (a skipped step's update)."""
    return jax.tree.map(lambda d: jnp.where(ok, d, jnp.zeros_like(d)), tree)


def floating_buckets(tree: PyTree, compressor: Compressor, bucket_bytes: int | None) -> int:
    """How many non-empty floating buckets the collectives cut ``tree`` into."""
    _, _, buckets = plan_tree(tree, compressor, bucket_bytes)
    return sum(1 for b in buckets if b.numel and not b.exact)


def keep_error_feedback(ok, new, old, tree, compressor, bucket_bytes):
    """The collectives' new state, or on a skipped step (``ok`` false) every bucket's old one.

    Each bucket's guard keeps only its own error feedback when its own mean is not finite; an
    optimizer that skips the whole step keeps all of them (the count of non-finite calls still
    moves). With one floating bucket the guard has already done it: no select.
    """
    if not isinstance(new, ReduceState) or floating_buckets(tree, compressor, bucket_bytes) <= 1:
        return new
    return new._replace(buckets=keep_if(ok, new.buckets, old.buckets))
