"""Sharded data parallel (ZeRO 1-2) of a Flax NNX model: ``jc.sharded`` inside ``nnx.Optimizer``.

    python examples/flax_nnx_sharded.py [--steps 200]

The same NNX training step as ``examples/flax_nnx.py`` (``nnx.Optimizer(model, tx, wrt=nnx.Param)``,
``optimizer.update(model, grads)`` inside ``jax.shard_map``); only the transformation changes:
``jc.sharded(optax.adamw(lr), "dp", ...)`` keeps on each device the AdamW state of its ``1/n``
share of the parameters, reduce-scatters the local gradients, updates its shard and all-gathers
the new parameters. Two runs on the same batches (a character-level MLP on
``jaxcomm.cli.textdata``):

* ``exact``: fp32 reduce-scatter and all-gather (the same bytes as an fp32 all-reduce; the same
  parameters as plain data-parallel AdamW, to fp32 rounding);
* ``int8``: int8 gradients (ZeRO++ qgZ, with error feedback) and int8 weights (qwZ; each device
  keeps its exact master shard).

It prints the loss, the bytes each device sends per step (compiled HLO) and the optimizer-state
bytes each device holds against plain data parallelism (read from the arrays).
"""

from __future__ import annotations

import argparse
import os

import jax
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

CONTEXT, EMBED, HIDDEN, BATCH_PER_DEVICE, LR, WEIGHT_DECAY = 16, 16, 128, 32, 3e-3, 1e-4


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


def make_tx(axis: str, n: int, compressed: bool) -> optax.GradientTransformation:
    """AdamW, sharded over ``axis``; int8 gradients and weights when ``compressed``."""
    inner = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    if not compressed:
        return jc.sharded(inner, axis, axis_size=n)
    return jc.sharded(
        inner,
        axis,
        compressor=jc.Quantize(bits=8, error_feedback=True),  # qgZ
        gather_compressor=jc.Quantize(bits=8),  # qwZ
        axis_size=n,
    )


def make_step(mesh, axis: str, model: CharMLP, tx: optax.GradientTransformation):
    """The jitted ``shard_map`` step and its initial state, for ``model`` trained with ``tx``."""
    n = mesh.shape[axis]
    # tx.init runs here, outside the axis: jc.sharded builds device 0's shard state (AdamW's
    # zero moments, the same for every device); stack_per_device gives every device its row.
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer = jc.stack_per_device(optimizer, n)  # the whole ShardedState is per device
    graphdef, state = nnx.split((model, optimizer))
    specs = nnx.state(jc.state_partition_specs((model, optimizer), axis))  # same tree as state
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def body(state, batch):  # runs on each device, with its slice of the batch
        model, optimizer = nnx.merge(graphdef, state)
        optimizer = jc.local_view(optimizer)  # per-device leaves arrive as (1, ...) blocks
        # Gradients w.r.t. a device-varying copy of the replicated parameters, so JAX does not
        # all-reduce them itself: jc.sharded reduce-scatters them instead.
        varying = jax.tree.map(lambda p: jax.lax.pcast(p, axis, to="varying"), model)
        loss, grads = nnx.value_and_grad(loss_fn)(varying, batch)
        optimizer.update(model, grads)  # scatter, AdamW on this device's shard, gather
        state = nnx.state((model, jc.global_view(optimizer)))
        return state, jax.lax.pmean(loss, axis)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()))
    return jax.jit(mapped, donate_argnums=0), graphdef, state


def opt_state_bytes(optimizer_state) -> int:
    """Optimizer-state bytes that device 0 holds, read from the arrays."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(optimizer_state))


def train(mesh, axis: str, tx, batches, vocab: int, name: str = "", log=print):
    """Train a fresh ``CharMLP`` (seed 0) with ``tx``; returns model, losses, bytes."""
    model = CharMLP(vocab, nnx.Rngs(0))
    step, graphdef, state = make_step(mesh, axis, model, tx)
    state_bytes = opt_state_bytes(state[1].opt_state)  # (model, optimizer) -> its optax state
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for i, batch in enumerate(batches):
        state, loss = compiled(state, batch)
        losses.append(float(loss))
        if log and (i % max(1, len(batches) // 4) == 0 or i == len(batches) - 1):
            log(f"  {name:<8} step {i:4d}  loss {losses[-1]:.4f}")
    model, _ = nnx.merge(graphdef, state)
    return model, losses, wire_bytes(compiled.as_text()), state_bytes


def main(steps: int = 200, log=print, runs=("exact", "int8")) -> dict:
    axis = "dp"
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    data = CharBatches.from_corpus(context=CONTEXT)
    rng = np.random.default_rng(0)
    batches = [data.sample(rng, (n * BATCH_PER_DEVICE,)) for _ in range(steps)]
    results = {
        name: train(
            mesh, axis, make_tx(axis, n, name == "int8"), batches, data.vocab_size, name, log
        )
        for name in runs
    }
    # Plain data parallel holds the full AdamW state on every device (replicated).
    model = CharMLP(data.vocab_size, nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.adamw(LR, weight_decay=WEIGHT_DECAY), wrt=nnx.Param)
    plain_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(plain, nnx.OptState)))
    if log:
        numel = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        log(f"\n{n} devices, {steps} steps, {numel:,} parameters; bytes per device")
        for name, (_, losses, b, sb) in results.items():
            log(
                f"{name:<8} loss {losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}  "
                f"wire/step {b:9,.0f} B (HLO)  optimizer state {sb:,} B "
                f"({plain_bytes / sb:.1f}x less than plain data parallel's {plain_bytes:,} B)"
            )
    return {
        "models": {k: v[0] for k, v in results.items()},
        "losses": {k: v[1] for k, v in results.items()},
        "step_bytes": {k: v[2] for k, v in results.items()},
        "state_bytes": {k: v[3] for k, v in results.items()},
        "plain_state_bytes": plain_bytes,
        "batches": batches,
        "vocab": data.vocab_size,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    main(args.steps)
