"""DiLoCo on a Flax NNX model: ``jc.diloco`` inside ``nnx.Optimizer``, one all-reduce per H steps.

    python examples/flax_nnx_diloco.py [--steps 200] [--sync-every 25]

The NNX training step of ``examples/flax_nnx.py`` (``nnx.Optimizer(model, tx, wrt=nnx.Param)``,
``optimizer.update(model, grads)`` inside ``jax.shard_map``) with one change of substance: with
DiLoCo every device trains **its own copy** of the model between syncs, so the model's state is
per device too (stacked ``(n, ...)``, ``P("dp")``), like the optimizer's per-device leaves. The
model to evaluate is the outer one, ``jc.diloco_params(optimizer.opt_state)``.

Two runs on the same batches (a character-level MLP on ``jaxcomm.cli.textdata``):

* ``adam``: ``optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(lr))``, an
  fp32 all-reduce of the gradients every step;
* ``diloco int4``: ``jc.diloco(optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True),
  sync_every=H, compressor=jc.Quantize(bits=4, error_feedback=True))``: local Adam steps and,
  every ``H`` steps, an int4 all-reduce of the pseudo-gradients with error feedback.

It prints the held-out loss of each and the bytes each device sent in the whole run (compiled
HLO of the step; a DiLoCo step program holds the sync, which runs once every ``H`` steps).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.cli.textdata import CharBatches
from jaxcomm.inspect import wire_bytes

if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)  # simulated devices; before any computation

CONTEXT, EMBED, HIDDEN, BATCH_PER_DEVICE, LR = 16, 16, 128, 32, 3e-3


class CharMLP(nnx.Module):
    """Embed ``CONTEXT`` characters, one hidden layer, logits of the next character."""

    def __init__(self, vocab: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, EMBED, rngs=rngs)
        self.hidden = nnx.Linear(CONTEXT * EMBED, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, vocab, rngs=rngs)

    def __call__(self, inputs):
        h = self.embed(inputs).reshape(inputs.shape[0], -1)
        return self.out(nnx.relu(self.hidden(h)))


def loss_fn(model: CharMLP, batch) -> jax.Array:
    inputs, targets = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()


def make_step(mesh, axis: str, model: CharMLP, tx, per_device_model: bool):
    """The jitted ``shard_map`` step and its initial (model, optimizer) states."""
    n = mesh.shape[axis]
    optimizer = jc.stack_per_device(nnx.Optimizer(model, tx, wrt=nnx.Param), n)
    opt_graph, opt_state = nnx.split(optimizer)
    opt_specs = nnx.state(jc.state_partition_specs(optimizer, axis))
    model_graph, model_state = nnx.split(model)
    model_spec = P(axis) if per_device_model else P()
    model_specs = jax.tree.map(lambda _: model_spec, model_state)
    if per_device_model:  # every device starts from the same copy
        model_state = jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n, *x.shape)), model_state)
    specs = (model_specs, opt_specs)
    state = (model_state, opt_state)
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def body(state, batch):  # one device, its slice of the batch
        model_state, opt_state = state
        if per_device_model:
            model_state = jax.tree.map(lambda x: x[0], model_state)
        model = nnx.merge(model_graph, model_state)
        optimizer = jc.local_view(nnx.merge(opt_graph, opt_state))
        # Local gradients: w.r.t. a device-varying copy, so JAX adds no all-reduce of its own
        # (DiLoCo's per-device model already is one).
        varying = model
        if not per_device_model:
            varying = jax.tree.map(lambda p: jax.lax.pcast(p, axis, to="varying"), model)
        loss, grads = nnx.value_and_grad(loss_fn)(varying, batch)
        optimizer.update(model, grads)  # the transformation communicates (or not, between syncs)
        model_state = nnx.state(model)
        if per_device_model:
            model_state = jax.tree.map(lambda x: x[None], model_state)
        return (model_state, nnx.state(jc.global_view(optimizer))), jax.lax.pmean(loss, axis)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()))
    return jax.jit(mapped, donate_argnums=0), (model_graph, opt_graph), state


def train(mesh, axis, tx, batches, vocab, *, diloco: bool, name: str, log=print):
    """Train a fresh ``CharMLP`` (seed 0); returns the model to evaluate and the step's bytes."""
    model = CharMLP(vocab, nnx.Rngs(0))
    step, (model_graph, opt_graph), state = make_step(mesh, axis, model, tx, diloco)
    compiled = step.lower(state, batches[0]).compile()
    for i, batch in enumerate(batches):
        state, loss = compiled(state, batch)
        if log and (i % max(1, len(batches) // 4) == 0 or i == len(batches) - 1):
            log(f"  {name:<12} step {i:4d}  loss {float(loss):.4f}")
    model_state, opt_state = state
    if diloco:  # the outer parameters theta: the model DiLoCo trains
        optimizer = nnx.merge(opt_graph, opt_state)
        model_state = jax.tree.map(lambda x: x[0], model_state)
        model = nnx.merge(model_graph, model_state)
        nnx.update(model, jc.diloco_params(optimizer.opt_state))
    else:
        model = nnx.merge(model_graph, model_state)
    return model, wire_bytes(compiled.as_text())


def main(steps: int = 200, sync_every: int = 25, log=print) -> dict:
    axis = "dp"
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    data = CharBatches.from_corpus(context=CONTEXT)
    rng = np.random.default_rng(0)
    batches = [data.sample(rng, (n * BATCH_PER_DEVICE,)) for _ in range(steps)]
    held = data.held_out(2048)
    adam = optax.chain(jc.compressed_mean(axis, jc.NoCompression(), axis_size=n), optax.adam(LR))
    diloco = jc.diloco(
        optax.adam(LR),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        sync_every=sync_every,
        axis_name=axis,
        compressor=jc.Quantize(bits=4, error_feedback=True),
        axis_size=n,  # tx.init runs outside the axis (in nnx.Optimizer)
    )
    runs = {
        "adam": (adam, False, steps),  # all-reduce every step
        "diloco int4": (diloco, True, steps // sync_every),  # one all-reduce per sync
    }
    results = {}
    for name, (tx, is_diloco, reductions) in runs.items():
        model, step_bytes = train(
            mesh, axis, tx, batches, data.vocab_size, diloco=is_diloco, name=name, log=log
        )
        held_loss = float(loss_fn(model, held))
        results[name] = dict(model=model, held_out=held_loss, total_bytes=reductions * step_bytes)
    if log:
        base = results["adam"]["total_bytes"]
        log(f"\n{n} devices, {steps} steps, DiLoCo H = {sync_every}; bytes from compiled HLO")
        for name, r in results.items():
            log(
                f"{name:<12} held-out loss {r['held_out']:.4f}  total bytes/device "
                f"{r['total_bytes']:12,.0f}  ({base / r['total_bytes']:5.1f}x less than adam)"
            )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=25)
    args = parser.parse_args()
    main(args.steps, args.sync_every)
