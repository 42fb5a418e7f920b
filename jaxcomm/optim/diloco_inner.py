"""DiLoCo's inner step: the inner optimizer on one device's copy, skipped on a bad gradient.

A step whose gradient is not finite on a device is not taken there: its parameters and inner
state are kept (the update is zero). The check reads the gradient before the inner update, so
the update runs inside a ``lax.cond`` whose taken branch updates the donated state in place;
checking the new copy instead would need a second pass of selects over the state after the
update, and copies of it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm.comm.axes import AxisName
from jaxcomm.optim._common import varying
from jaxcomm.optim._skip import all_finite


def make_inner_step(inner: optax.GradientTransformation, axis_name: AxisName) -> Callable:
    """``inner_step(updates, inner_state, params, blocked) -> (ok, inner_updates, inner_state)``.

    ``ok``: this device's gradient is finite (a float sum, see :func:`all_finite`); when it is
    not, ``inner_updates`` are zeros and ``inner_state`` the input's. ``blocked``: the inner
    state's leaves are the ``(1, ...)`` blocks of ``jc.local_view`` (the inner optimizer then
    runs under ``vmap`` over that axis, so it sees its usual shapes and XLA updates its donated
    state in place).
    """

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

        ok = all_finite(updates)
        new_updates, new_state = lax.cond(ok, take, skip, updates, inner_state, params)
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        return ok, new_updates, new_state

    return inner_step
