"""Data-parallel training with plain optax and ``jax.shard_map``, communicating through jaxcomm.

    python examples/optax_shard_map.py [--steps 200]

A character-level MLP language model (``jaxcomm.cli.textdata``: Python's bundled documentation, no
download) is trained on every device of a 1-D mesh (8 simulated CPU devices unless
``JAX_NUM_CPU_DEVICES`` says otherwise), four ways, on the same batches:

1. ``exact``: ``optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(lr))``,
   i.e. the fp32 mean of the gradients, then Adam (the baseline);
2. ``1-bit mean + adam``: ``optax.chain(jc.compressed_mean("dp"), optax.adam(lr))``, the
   two-line change to an existing optax loop;
3. ``onebit_adam``: ``jc.onebit_adam(lr, freeze_step=..., axis_name="dp")`` (exact warm-up,
   then a 1-bit all-reduce of Adam's momentum);
4. the same 1-bit Adam through a hand-written ``shard_map`` step built from jaxcomm's spec
   helpers: what ``jc.make_train_step`` does for you. It gives the same parameters bit for bit.

Each step is compiled once and the bytes each device sends per step are read from the compiled
HLO (``jaxcomm.inspect.wire_bytes``), not timed. (``onebit_adam`` bias-corrects by default, as
``optax.adam`` does; ``deepspeed_compat=True`` drops the correction, as DeepSpeed, and its early
steps are then larger than ``optax.adam``'s at the same learning rate.)
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


def handwritten_train_step(mesh, axis: str, tx: optax.GradientTransformation, params):
    """A ``shard_map`` train step written out by hand: ``jc.make_train_step`` in ten lines."""
    n = mesh.shape[axis]
    # One device's optimizer state (``tx`` was built with ``axis_size=n``, since no axis is bound
    # here), then the global layout: per-device leaves (the 1-bit error feedback) stacked
    # (n, ...) and partitioned over the axis, everything else replicated.
    state = jc.TrainState(params, jc.stack_per_device(tx.init(params), n))
    specs = jc.train_state_specs(state, axis)  # P(axis) for per-device leaves, P() otherwise
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def body(state, batch):  # runs on each device, with its slice of the batch
        state = jc.local_view(state)  # per-device leaves arrive as (1, ...) blocks
        # Differentiate w.r.t. a device-varying copy of the (replicated) parameters: otherwise
        # JAX all-reduces their gradients in fp32 itself, the very traffic jaxcomm replaces.
        varying = jax.tree.map(lambda p: jax.lax.pcast(p, axis, to="varying"), state.params)
        loss, grads = jax.value_and_grad(loss_fn)(varying, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)  # communicates
        new = jc.TrainState(optax.apply_updates(state.params, updates), opt_state)
        return jc.global_view(new), jax.lax.pmean(loss, axis)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()))
    return jax.jit(mapped, donate_argnums=0), state


def bit_for_bit(a, b) -> bool:
    """Same structure and the same bits in every leaf (so a NaN equals the same NaN)."""
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def diverged_at(losses) -> int | None:
    """1-based step of the first non-finite loss, or None: such a run did not train."""
    bad = np.flatnonzero(~np.isfinite(np.asarray(losses, dtype=float)))
    return int(bad[0]) + 1 if bad.size else None


def train(step, state, batches, name: str, log=print):
    """Compile ``step`` once, read its bytes per device from the HLO, run it on ``batches``."""
    compiled = step.lower(state, batches[0]).compile()
    step_bytes = wire_bytes(compiled.as_text())
    losses = []
    for i, batch in enumerate(batches):
        state, loss = compiled(state, batch)
        losses.append(float(loss))
        if log and (i % max(1, len(batches) // 4) == 0 or i == len(batches) - 1):
            log(f"  {name:<22} step {i:4d}  loss {losses[-1]:.4f}")
    return state, losses, step_bytes


def main(steps: int = 200, warmup: int | None = None, log=print) -> dict:
    axis = "dp"
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    data = CharBatches.from_corpus(context=CONTEXT)
    rng = np.random.default_rng(0)
    batches = [data.sample(rng, (n * BATCH_PER_DEVICE,)) for _ in range(steps)]
    params = init_params(data.vocab_size)
    # Exact warm-up (20% of the steps by default). 1-bit Adam freezes Adam's variance when it
    # ends: it must be long enough for every parameter to have had gradients (every character
    # seen), or sign-compressed momentum divided by a zero variance blows up.
    warm = max(1, steps // 5) if warmup is None else warmup

    runs = {
        "exact": optax.chain(jc.compressed_mean(axis, jc.NoCompression()), optax.adam(LR)),
        "1-bit mean + adam": optax.chain(
            jc.compressed_mean(axis, warmup_steps=warm), optax.adam(LR)
        ),
        "onebit_adam": jc.onebit_adam(LR, freeze_step=warm, axis_name=axis, axis_size=n),
    }
    results = {}
    for name, tx in runs.items():
        # One program for both stages (specialize_phases=False), so that one compiled HLO shows
        # the warm-up's and the compressed steps' bytes, and the hand-written step below (also
        # one program) can be compared with it bit for bit. The default compiles one program per
        # stage: same results to fp32 rounding, faster steps.
        step, state = jc.make_train_step(
            mesh, axis, loss_fn, tx, params, specialize_phases=False
        )
        results[name] = train(step, state, batches, name, log)
    step, state = handwritten_train_step(mesh, axis, runs["onebit_adam"], params)
    results["onebit_adam, by hand"] = train(step, state, batches, "onebit_adam, by hand", log)

    # A warm-up and a compressed stage are compiled into one program (lax.cond picks one per
    # step): warm-up steps send what the exact step sends, compressed steps the rest.
    exact_b = results["exact"][2]
    per_step = {"exact": [exact_b] * steps}
    compressed_b = {}
    for name in ("1-bit mean + adam", "onebit_adam"):
        compressed_b[name] = results[name][2] - exact_b
        per_step[name] = [exact_b] * warm + [compressed_b[name]] * (steps - warm)
    if log:
        size = sum(p.size for p in jax.tree.leaves(params))
        log(f"\n{n} devices, {steps} steps ({warm} warm-up), {size:,} parameters")
        log(f"{'method':<18} {'first loss':>10} {'last loss':>10} {'bytes/step':>11} "
            f"{'compressed':>11} {'total vs exact':>15}")
        for name, b in per_step.items():
            losses = results[name][1]
            # A run that diverged saved nothing: no traffic ratio for it.
            ratio = "diverged" if diverged_at(losses) else (
                "baseline" if name == "exact" else f"{sum(per_step['exact']) / sum(b):.1f}x less")
            log(f"{name:<18} {losses[0]:10.4f} {np.mean(losses[-10:]):10.4f} "
                f"{np.mean(b):11,.0f} {compressed_b.get(name, exact_b):11,.0f} {ratio:>15}")
        for name, (_, losses, _) in results.items():
            step = diverged_at(losses)
            if step is not None:
                log(f"WARNING: {name} diverged: loss {losses[step - 1]} at step {step} "
                    f"(warm-up: {warm} steps). 1-bit methods need a warm-up long enough for "
                    "Adam's variance to settle before compression starts: use more --steps or "
                    "a larger --warmup.")
    # Bit for bit, so that a diverged run's NaN (the same NaN in both) is not a mismatch.
    same = bit_for_bit(results["onebit_adam"][0], results["onebit_adam, by hand"][0])
    if log:
        both_nan = diverged_at(results["onebit_adam"][1]) is not None
        log(f"hand-written shard_map step == jc.make_train_step, bit for bit: {same}"
            + (" (both diverged identically)" if same and both_nan else ""))
    return {
        "losses": {k: v[1] for k, v in results.items()},
        "step_bytes": {k: v[2] for k, v in results.items()},
        "bytes_per_step": {k: float(np.mean(v)) for k, v in per_step.items()},
        "compressed_step_bytes": compressed_b,
        "states": {k: v[0] for k, v in results.items()},
        "handwritten_matches": same,
        "diverged": {k: diverged_at(v[1]) for k, v in results.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=None, help="exact steps (default: 20%%)")
    args = parser.parse_args()
    main(args.steps, args.warmup)
