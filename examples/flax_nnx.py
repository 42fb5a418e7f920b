"""Data-parallel training of a Flax NNX model with ``nnx.Optimizer`` and a jaxcomm transformation.

    python examples/flax_nnx.py [--steps 200]

The usual NNX training step (``nnx.Optimizer(model, tx, wrt=nnx.Param)``, then
``optimizer.update(model, grads)``) runs on every device of a 1-D mesh inside ``jax.shard_map``:
``nnx.split`` the model and optimizer into a graphdef and a state, pass the state through
``shard_map`` with the specs jaxcomm gives, ``nnx.merge`` inside the body, update, split back out.
The only jaxcomm-specific lines are the transformation and the specs.

Two runs on the same batches (a character-level MLP on ``jaxcomm.cli.textdata``):
``optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(lr))`` (exact mean of the
gradients) and ``optax.chain(jc.compressed_mean("dp", warmup_steps=...), optax.adam(lr))``
(1-bit with error feedback after an exact warm-up), with the bytes each device sends per step
read from the compiled HLO.
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


def make_step(mesh, axis: str, model: CharMLP, tx: optax.GradientTransformation):
    """The jitted ``shard_map`` step and its initial state, for ``model`` trained with ``tx``."""
    n = mesh.shape[axis]
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # tx.init: built with axis_size=n
    # NNX modules are pytrees, so jaxcomm's layout helpers apply to them directly (while they
    # still hold the optax state's NamedTuples, which say which leaves are per device):
    # per-device leaves (error feedback) stacked (n, ...), their specs P(axis), the rest P().
    optimizer = jc.stack_per_device(optimizer, n)
    graphdef, state = nnx.split((model, optimizer))
    specs = nnx.state(jc.state_partition_specs((model, optimizer), axis))  # same tree as state
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def body(state, batch):  # runs on each device, with its slice of the batch
        model, optimizer = nnx.merge(graphdef, state)
        optimizer = jc.local_view(optimizer)  # per-device leaves arrive as (1, ...) blocks
        # Gradients w.r.t. a device-varying copy of the replicated parameters: otherwise JAX
        # all-reduces them in fp32 itself, the very traffic the transformation replaces.
        varying = jax.tree.map(lambda p: jax.lax.pcast(p, axis, to="varying"), model)
        loss, grads = nnx.value_and_grad(loss_fn)(varying, batch)
        optimizer.update(model, grads)  # tx averages the local grads across devices
        state = nnx.state((model, jc.global_view(optimizer)))
        return state, jax.lax.pmean(loss, axis)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()))
    return jax.jit(mapped, donate_argnums=0), graphdef, state


def train(mesh, axis: str, tx, batches, vocab: int, name: str = "", log=print):
    """Train a fresh ``CharMLP`` (seed 0) with ``tx``; returns the model, losses, bytes/step."""
    model = CharMLP(vocab, nnx.Rngs(0))
    step, graphdef, state = make_step(mesh, axis, model, tx)
    compiled = step.lower(state, batches[0]).compile()  # compile once: run it and read its HLO
    losses = []
    for i, batch in enumerate(batches):
        state, loss = compiled(state, batch)
        losses.append(float(loss))
        if log and (i % max(1, len(batches) // 4) == 0 or i == len(batches) - 1):
            log(f"  {name:<18} step {i:4d}  loss {losses[-1]:.4f}")
    model, _ = nnx.merge(graphdef, state)  # the trained model, ready for eval or export
    return model, losses, wire_bytes(compiled.as_text())


def main(steps: int = 200, warmup: int | None = None, log=print, compressors=None) -> dict:
    axis = "dp"
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    data = CharBatches.from_corpus(context=CONTEXT)
    rng = np.random.default_rng(0)
    batches = [data.sample(rng, (n * BATCH_PER_DEVICE,)) for _ in range(steps)]
    # Exact mean for the first steps (20% by default): 1-bit compression of the large early
    # gradients slows training down (here: 200 steps, loss 2.97 without warm-up, 2.62 with).
    warm = max(1, steps // 5) if warmup is None else warmup
    if compressors is None:
        compressors = {"exact": jc.NoCompression(), "1-bit mean + adam": jc.OneBit()}
    results = {}
    for name, compressor in compressors.items():
        exact = isinstance(compressor, jc.NoCompression)  # no warm-up stage to compile then
        mean = jc.compressed_mean(axis, compressor, warmup_steps=0 if exact else warm, axis_size=n)
        tx = optax.chain(mean, optax.adam(LR))
        results[name] = train(mesh, axis, tx, batches, data.vocab_size, name, log)
    if log and "exact" in results:
        exact_b = results["exact"][2]
        log(f"\n{n} devices, {steps} steps ({warm} warm-up); bytes per device from compiled HLO")
        for name, (_, losses, b) in results.items():
            # Both stages are in one program (lax.cond): compressed steps send b - exact_b.
            compressed = b - exact_b if name != "exact" else exact_b
            total = warm * exact_b + (steps - warm) * compressed
            log(f"{name:<18} loss {losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}  "
                f"bytes/step {compressed:9,.0f} (warm-up {exact_b:,.0f}), "
                f"total {steps * exact_b / total:4.1f}x less than exact")
    return {
        "models": {k: v[0] for k, v in results.items()},
        "losses": {k: v[1] for k, v in results.items()},
        "step_bytes": {k: v[2] for k, v in results.items()},
        "batches": batches,
        "vocab": data.vocab_size,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=None, help="exact steps (default: 20%%)")
    args = parser.parse_args()
    main(args.steps, args.warmup)
