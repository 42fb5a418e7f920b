"""1-bit LAMB vs exact LAMB: final loss, held-out loss and accuracy, bytes on the wire.

Trains the examples' character-level MLP (``jaxcomm.cli.textdata``: Python's bundled docs,
offline) data-parallel on 8 simulated CPU devices, on the same batches, with

* ``exact + optax.lamb``: the fp32 mean of the gradients, then ``optax.lamb(lr)`` (the
  baseline; optax's LAMB has bias correction and an unclipped trust ratio);
* ``onebit_lamb, exact comm``: ``jc.onebit_lamb(..., compressor=jc.NoCompression())``, the
  same algorithm without compression error (frozen trust ratios, correction factor);
* ``onebit_lamb``: ``jc.onebit_lamb(lr, freeze_step=warmup, axis_name="dp")``.

Bytes per device per step are read from the compiled HLO (:func:`jaxcomm.inspect.wire_bytes`).
Both stages of ``onebit_lamb`` are compiled into one program (``lax.cond``): warm-up steps send
what the exact step sends, compressed steps the rest. Totals count every step, warm-up
included. Held-out metrics are on 4,096 fixed held-out windows.

Usage::

    python benchmarks/onebit_lamb.py [--steps 600] [--warmup 120] [--lr 0.01] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

CONTEXT, EMBED, HIDDEN, BATCH_PER_DEVICE = 16, 16, 128, 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=None, help="exact steps (default 20%%)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax

    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxcomm as jc
    from jaxcomm.cli.progress import StepLog
    from jaxcomm.cli.textdata import CharBatches
    from jaxcomm.inspect import wire_bytes

    steps, lr = args.steps, args.lr
    warm = max(1, steps // 5) if args.warmup is None else args.warmup
    axis, n = "dp", jax.device_count()
    mesh = jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    data = CharBatches.from_corpus(context=CONTEXT)
    rng = np.random.default_rng(0)
    batches = [data.sample(rng, (n * BATCH_PER_DEVICE,)) for _ in range(steps)]
    held_inputs, held_targets = data.held_out(4096)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    vocab = data.vocab_size
    params = {
        "embed": jax.random.normal(k1, (vocab, EMBED)) * 0.5,
        "w1": jax.random.normal(k2, (CONTEXT * EMBED, HIDDEN)) / np.sqrt(CONTEXT * EMBED),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k3, (HIDDEN, vocab)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((vocab,)),
    }

    def logits_fn(p, inputs):
        h = p["embed"][inputs].reshape(inputs.shape[0], -1)
        return jax.nn.relu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss_fn(p, batch):
        inputs, targets = batch
        logits = logits_fn(p, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    runs = {
        "exact + optax.lamb": optax.chain(
            jc.compressed_mean(axis, jc.NoCompression()), optax.lamb(lr)
        ),
        "onebit_lamb, exact comm": jc.onebit_lamb(
            lr, freeze_step=warm, axis_name=axis, compressor=jc.NoCompression()
        ),
        "onebit_lamb": jc.onebit_lamb(lr, freeze_step=warm, axis_name=axis),
    }
    rows = {}
    for name, tx in runs.items():
        step, state = jc.make_train_step(mesh, axis, loss_fn, tx, params)
        compiled = step.lower(state, batches[0]).compile()
        hlo_bytes = wire_bytes(compiled.as_text())
        losses = []
        progress = StepLog(name, len(batches))
        for batch in batches:
            state, loss = compiled(state, batch)
            losses.append(float(loss))
            progress.step(1, losses[-1])
        p = jc.params_of(state)
        logits = logits_fn(p, held_inputs)
        held_loss = optax.softmax_cross_entropy_with_integer_labels(logits, held_targets).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == held_targets)
        rows[name] = {
            "method": name,
            "train_loss_last10": float(np.mean(losses[-10:])),
            "heldout_loss": float(held_loss),
            "heldout_accuracy": float(accuracy),
            "hlo_bytes": float(hlo_bytes),
        }
    exact_b = rows["exact + optax.lamb"]["hlo_bytes"]
    for name, row in rows.items():
        staged = name != "exact + optax.lamb"
        compressed = row["hlo_bytes"] - exact_b if staged else exact_b
        total = warm * exact_b + (steps - warm) * compressed if staged else steps * exact_b
        row.update(compressed_step_bytes=compressed, total_bytes=total)
        row["traffic_ratio"] = steps * exact_b / total
        row["heldout_loss_vs_exact"] = (
            row["heldout_loss"] / rows["exact + optax.lamb"]["heldout_loss"] - 1
        )

    size = sum(x.size for x in jax.tree.leaves(params))
    print(f"{n} devices, {steps} steps ({warm} warm-up), lr {lr}, {size:,} parameters")
    print(
        f"{'method':<24} {'train':>7} {'held-out':>9} {'acc':>6} {'bytes/step':>11} "
        f"{'total':>12} {'vs exact':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<24} {r['train_loss_last10']:7.4f} {r['heldout_loss']:9.4f} "
            f"{100 * r['heldout_accuracy']:5.1f}% {r['compressed_step_bytes']:11,.0f} "
            f"{r['total_bytes']:12,.0f} {r['traffic_ratio']:8.1f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(list(rows.values()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
