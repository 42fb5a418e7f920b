"""Data-parallel training with ``jax.pmap`` and jaxcomm's transformations.

    python examples/pmap.py [--steps 200]

The same character-level MLP as ``examples/optax_shard_map.py``, trained three ways on the same
batches:

1. ``pmean + adam``: the classic pmap step, ``grads = lax.pmean(grads, "dp")`` then
   ``optax.adam`` (the baseline);
2. ``onebit_adam, by hand``: the same step with the ``pmean`` line deleted and ``optax.adam``
   swapped for ``jc.onebit_adam(...)``, which averages the local gradients itself (exactly
   during warm-up, then as 1-bit momentum with error feedback);
3. ``onebit_adam``: the step ``jc.make_pmap_train_step`` builds for you; it gives the same
   parameters bit for bit.

Under pmap every leaf of the state carries a leading device axis; ``jc.from_pmap_layout`` turns
it into the shard_map layout (e.g. to checkpoint interchangeably). Bytes per device per step
are read from the compiled HLO.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm as jc
from jaxcomm.cli.textdata import CharBatches
from jaxcomm.inspect import wire_bytes

if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)  # simulated devices; before any computation

CONTEXT, EMBED, HIDDEN, BATCH_PER_DEVICE, LR = 16, 16, 128, 32, 3e-3


def init_params(vocab: int, seed: int = 0) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": jax.random.normal(k1, (vocab, EMBED)) * 0.5,
        "w1": jax.random.normal(k2, (CONTEXT * EMBED, HIDDEN)) / np.sqrt(CONTEXT * EMBED),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k3, (HIDDEN, vocab)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((vocab,)),
    }


def loss_fn(params: dict, batch) -> jax.Array:
    """Mean next-character cross-entropy over this device's batch."""
    inputs, targets = batch
    h = params["embed"][inputs].reshape(inputs.shape[0], -1)
    h = jax.nn.relu(h @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def pmap_train_step(axis: str, tx: optax.GradientTransformation, params, n: int, pmean: bool):
    """A hand-written pmap step and its initial ``(params, opt_state)``, every leaf ``(n, ...)``.

    ``pmean=True``: plain data parallelism (fp32 all-reduce of the gradients, then ``tx``).
    ``pmean=False``: ``tx`` is a jaxcomm transformation and does the communication itself.
    """
    # Init where the axis is bound, so jaxcomm sizes its error feedback for n devices.
    opt_state = jax.pmap(lambda _: tx.init(params), axis_name=axis)(jnp.arange(n))
    stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params)

    @partial(jax.pmap, axis_name=axis, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # this device's gradients
        if pmean:
            grads = jax.lax.pmean(grads, axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis)

    return step, (stacked, opt_state)


def split(batch, n: int):
    """Global batch -> ``(n, per_device, ...)``, the leading axis pmap maps over."""
    return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)


def run(step, carry, batches, name: str, log=print):
    """Compile once (bytes from its HLO), then train; ``carry`` is the pmapped state tuple."""
    compiled = step.lower(*carry, batches[0]).compile()
    losses = []
    for i, batch in enumerate(batches):
        *carry, loss = compiled(*carry, batch)
        losses.append(float(np.asarray(loss).reshape(-1)[0]))
        if log and (i % max(1, len(batches) // 4) == 0 or i == len(batches) - 1):
            log(f"  {name:<22} step {i:4d}  loss {losses[-1]:.4f}")
    return carry, losses, wire_bytes(compiled.as_text())


def main(steps: int = 200, warmup: int | None = None, log=print) -> dict:
    axis = "dp"
    n = jax.local_device_count()
    data = CharBatches.from_corpus(context=CONTEXT)
    rng = np.random.default_rng(0)
    batches = [split(data.sample(rng, (n * BATCH_PER_DEVICE,)), n) for _ in range(steps)]
    params = init_params(data.vocab_size)
    # Exact warm-up (20% of the steps by default). 1-bit Adam freezes Adam's variance when it
    # ends: it must be long enough for every parameter to have had gradients (every character
    # seen), or sign-compressed momentum divided by a zero variance blows up.
    warm = max(1, steps // 5) if warmup is None else warmup
    onebit = jc.onebit_adam(LR, freeze_step=warm, axis_name=axis)
    results = {}

    step, carry = pmap_train_step(axis, optax.adam(LR), params, n, pmean=True)
    results["pmean + adam"] = run(step, carry, batches, "pmean + adam", log)
    step, carry = pmap_train_step(axis, onebit, params, n, pmean=False)
    results["onebit_adam, by hand"] = run(step, carry, batches, "onebit_adam, by hand", log)
    # The library's step: state = TrainState(params, opt_state), every leaf stacked (n, ...).
    # step(state, global_batch) splits the batch itself; step.pmapped takes it split.
    # One pmap for both stages, as the hand-written step (the default: one per stage).
    step, state = jc.make_pmap_train_step(axis, loss_fn, onebit, params, specialize_phases=False)
    (state,), losses, b = run(step.pmapped, (state,), batches, "onebit_adam", log)
    results["onebit_adam"] = ([state.params, state.opt_state], losses, b)

    # 1-bit Adam's program holds both stages (lax.cond): warm-up steps send what the pmean step
    # sends, compression steps the rest of its HLO bytes.
    exact_b = results["pmean + adam"][2]
    compressed_b = results["onebit_adam"][2] - exact_b
    total = warm * exact_b + (steps - warm) * compressed_b
    same = all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(results["onebit_adam"][0]),
            jax.tree.leaves(results["onebit_adam, by hand"][0]),
            strict=True,
        )
    )
    if log:
        log(f"\n{n} devices, {steps} steps ({warm} warm-up); bytes per device from compiled HLO")
        for name, (_, losses, _) in results.items():
            log(f"{name:<22} loss {losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}")
        log(f"bytes/step: pmean {exact_b:,.0f}; 1-bit Adam {compressed_b:,.0f} after warm-up "
            f"({exact_b / compressed_b:.1f}x less), {steps * exact_b / total:.1f}x less in total")
        log(f"hand-written pmap step == jc.make_pmap_train_step, bit for bit: {same}")
        # One copy of the trained parameters, and the state in the shard_map layout.
        trained = jc.params_of(state, pmap=True)
        log(f"trained w1: {trained['w1'].shape}; per-device leaves in the shard_map layout: "
            f"{[x.shape for x in jax.tree.leaves(jc.from_pmap_layout(state).opt_state.comm)]}")
    return {
        "losses": {k: v[1] for k, v in results.items()},
        "step_bytes": {k: v[2] for k, v in results.items()},
        "compressed_step_bytes": compressed_b,
        "handwritten_matches": same,
        "state": state,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=None, help="exact steps (default: 20%%)")
    args = parser.parse_args()
    main(args.steps, args.warmup)
