"""What one device computes in a train step: its gradients, the transformation (which
communicates), the new parameters and the step's metrics. Shared by ``make_train_step``
(inside ``shard_map``) and ``make_pmap_train_step`` (inside ``pmap``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._compat import ensure_varying
from jaxcomm.train.layout import TrainState


def _loss_and_grads(loss_fn, has_aux, params, batch):
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss, aux = out if has_aux else (out, None)
    return loss, aux, grads


def _mean_metrics(loss, aux, axis_name: str, has_aux: bool, mean: bool = True):
    if not mean:  # each device's own values, stacked over the axis: no collective
        local = (loss, aux) if has_aux else loss
        return jax.tree.map(lambda x: jnp.asarray(x)[None], local)
    loss = lax.pmean(loss, axis_name)
    if not has_aux:
        return loss
    return loss, jax.tree.map(lambda x: lax.pmean(x, axis_name), aux)


def local_train_step(
    loss_fn,
    tx,
    axis_name,
    has_aux,
    state: TrainState,
    batch,
    varying: bool,
    blocks=None,
    mean_metrics: bool = True,
):
    """One device's step: local grads -> ``tx`` (which communicates) -> new params.

    ``blocks``: the per-device parameters as the ``(1, *local)`` blocks shard_map hands them;
    the update is added to the blocks themselves, so that XLA writes them in place (through a
    squeeze and its inverse it would copy every parameter on XLA:CPU).
    """
    params = state.params
    grad_params = (
        jax.tree.map(lambda p: ensure_varying(p, axis_name), params) if varying else params
    )
    loss, aux, grads = _loss_and_grads(loss_fn, has_aux, grad_params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    if blocks is None:
        new_params = optax.apply_updates(params, updates)
    else:
        new_params = optax.apply_updates(
            blocks, jax.tree.map(lambda u, b: u.reshape(b.shape), updates, blocks)
        )
    metrics = _mean_metrics(loss, aux, axis_name, has_aux, mean_metrics)
    return TrainState(new_params, opt_state), metrics
