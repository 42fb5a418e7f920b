"""DiLoCo and Streaming DiLoCo vs Adam: held-out loss against bytes on the wire.

Trains a character-level LM (:func:`make_model`: an MLP over 32 embedded characters, 0.36M
parameters, Python's bundled docs, held-out split; the model and batches of ``jaxcomm demo``
before it moved to the byte-level transformer, which has its own ``diloco_int4`` row)
data-parallel on 8 simulated CPU devices:

* ``adam``: exact fp32 mean of the gradients every step, then ``optax.adam(lr)`` (the
  baseline);
* ``diloco``: ``jc.diloco(optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True), H,
  compressor=...)``: local Adam steps, every ``H`` steps an all-reduce of the pseudo-gradients
  (exact fp32, int8 + error feedback, or int4 + error feedback);
* ``streaming``: the same with ``fragments=F, overlap_steps=tau`` (int4 + error feedback).

Held-out loss is that of the outer parameters (``jc.diloco_params``) for DiLoCo. Bytes are per
device, read from the compiled HLO (``jaxcomm.inspect.wire_bytes``) of one reduction of each
fragment's leaves (and of the exact gradient mean for Adam), times the number of reductions the
run made. Usage (CPU-heavy: run it under the shared lock)::

    python benchmarks/diloco_convergence.py [--steps 1500] [--runs adam,h50-exact,...] \\
        [--json OUT]

``--runs`` picks from ``RUNS`` (default: all); ``--json`` merges into an existing file, so the
table can be built in several shorter invocations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

#: name -> (H, compressor name, fragments, overlap_steps); H = 0 means Adam every step.
RUNS = {
    "adam": (0, "exact", 1, 0),
    "h50-exact": (50, "exact", 1, 0),
    "h50-int8": (50, "int8", 1, 0),
    "h50-int4": (50, "int4", 1, 0),
    "h200-exact": (200, "exact", 1, 0),
    "h200-int8": (200, "int8", 1, 0),
    "h200-int4": (200, "int4", 1, 0),
    **{f"h50-f4-tau{tau}-int4": (50, "int4", 4, tau) for tau in range(1, 6)},
}
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
#: ``--background``: runs with ``overlap_steps >= 2`` sync on a host thread (same numbers).
BACKGROUND = {"on": False}


@dataclass(frozen=True)
class Config:
    """The task's sizes (the README's DiLoCo table)."""

    steps: int = 1500
    devices: int = 8
    batch_per_device: int = 32
    context: int = 32
    embed: int = 32
    hidden: int = 256
    learning_rate: float = 1e-3
    seed: int = 0


def make_model(cfg: Config, vocab_size: int):
    """A small MLP over embedded context characters (Flax NNX)."""
    from flax import nnx

    class CharMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab_size, cfg.embed, rngs=rngs)
            self.hidden1 = nnx.Linear(cfg.context * cfg.embed, cfg.hidden, rngs=rngs)
            self.hidden2 = nnx.Linear(cfg.hidden, cfg.hidden, rngs=rngs)
            self.out = nnx.Linear(cfg.hidden, vocab_size, rngs=rngs)

        def __call__(self, ids):
            h = self.embed(ids).reshape(*ids.shape[:-1], -1)
            h = nnx.gelu(self.hidden1(h))
            h = nnx.gelu(self.hidden2(h))
            return self.out(h)

    return CharMLP(nnx.Rngs(cfg.seed))


def compressor(name: str):
    import jaxcomm as jc

    return {
        "exact": None,
        "int8": jc.Quantize(bits=8, error_feedback=True),
        "int4": jc.Quantize(bits=4, error_feedback=True),
    }[name]


def reduction_bytes(mesh, axis: str, leaves, comp) -> float:
    """Bytes per device of one ``compressed_pmean`` of ``leaves`` (fp32), from the HLO."""
    import jaxcomm as jc
    from jaxcomm.inspect import mean_wire_bytes

    return mean_wire_bytes(mesh, axis, list(leaves), jc.NoCompression() if comp is None else comp)


def train(name: str, cfg, mesh, data, steps: int, eval_every: int) -> dict:
    import jax
    import optax
    from flax import nnx

    import jaxcomm as jc
    from jaxcomm.cli.progress import StepLog
    from jaxcomm.optim.diloco.state import fragment_leaves, fragment_offsets

    H, comp_name, F, tau = RUNS[name]
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    graphdef, params = nnx.split(make_model(cfg, data.vocab_size), nnx.Param)
    params = jax.tree.map(np.asarray, params)
    leaves = jax.tree.leaves(params)

    def loss_fn(params, batch):
        inputs, targets = batch
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    lr = cfg.learning_rate
    if H == 0:
        tx = optax.chain(jc.compressed_mean(axis, jc.NoCompression()), optax.adam(lr))
    else:
        tx = jc.diloco(
            optax.adam(lr),
            optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True),
            H,
            axis,
            compressor=compressor(comp_name),
            fragments=F,
            overlap_steps=tau,
            background=BACKGROUND["on"] and tau >= 2,
        )
    step, state = jc.make_train_step(mesh, axis, loss_fn, tx, params)
    held_inputs, held_targets = data.held_out(2048)

    @jax.jit
    def evaluate(params):
        logits = nnx.merge(graphdef, params)(held_inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, held_targets).mean()
        return loss, (logits.argmax(-1) == held_targets).mean()

    def model(state):
        if H == 0:
            return state.params
        theta = jc.diloco_params(state.opt_state)
        return jax.tree.map(lambda p, t: t.astype(p.dtype), params, theta)

    rng = np.random.default_rng(cfg.seed + 1)  # the old demo's batches
    curve = []
    start = time.perf_counter()
    progress = StepLog(name, steps)
    for i in range(steps):
        batch = data.sample(rng, (n * cfg.batch_per_device,))
        state, loss = step(state, batch)
        progress.step(1, loss)
        # One step at a time: queuing many programs with collectives on 8 simulated CPU
        # devices can starve XLA's rendezvous (threads wait for each other, then abort).
        loss.block_until_ready()
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            curve.append((i + 1, float(evaluate(model(state))[0])))
    seconds = time.perf_counter() - start
    loss, accuracy = (float(x) for x in evaluate(model(state)))

    # Bytes: Adam sends the exact mean every step; DiLoCo each fragment's reduction per sync.
    if H == 0:
        total = steps * reduction_bytes(mesh, axis, leaves, None)
        syncs, peak = steps, total / steps
    else:
        groups = fragment_leaves(len(leaves), F)
        per_fragment = [
            reduction_bytes(mesh, axis, [leaves[i] for i in ids], compressor(comp_name))
            for ids in groups
        ]
        total, syncs = 0.0, 0
        for off, b in zip(fragment_offsets(H, F), per_fragment, strict=True):
            # Syncs after steps t % H == off (t >= 1); with tau > 0 issued at t + 1 and merged
            # at t + tau, so only those merged within the run count.
            count = sum(1 for t in range(1, steps + 1) if t % H == off and t + tau <= steps)
            total += count * b
            syncs += count
        peak = max(per_fragment)
    skipped = 0 if H == 0 else int(state.opt_state.skips.total)
    return dict(
        name=name,
        H=H,
        compressor=comp_name,
        fragments=F,
        overlap_steps=tau,
        loss=loss,
        accuracy=accuracy,
        total_bytes=total,
        reductions=syncs,
        peak_reduction_bytes=peak,
        skipped=skipped,
        seconds=seconds,
        curve=curve,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--json", default=None, help="merge the rows into this JSON file")
    parser.add_argument(
        "--background", action="store_true", help="background=True where overlap_steps >= 2"
    )
    args = parser.parse_args(argv)
    BACKGROUND["on"] = args.background
    names = [r for r in args.runs.split(",") if r]
    unknown = [r for r in names if r not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {list(RUNS)}")

    import jax
    from jax.sharding import AxisType

    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", 8)
    from jaxcomm.cli.textdata import CharBatches

    cfg = Config(steps=args.steps)
    mesh = jax.make_mesh((cfg.devices,), ("dp",), axis_types=(AxisType.Auto,))
    data = CharBatches.from_corpus(context=cfg.context)
    rows = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
        if doc.get("steps") == args.steps:
            rows = {r["name"]: r for r in doc["rows"]}
    for name in names:
        rows[name] = train(name, cfg, mesh, data, args.steps, args.eval_every)
        r = rows[name]
        print(f"{name:>18}: held-out {r['loss']:.4f} ({r['seconds']:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(steps=args.steps, rows=list(rows.values())), f, indent=1)

    adam = rows.get("adam")
    print(
        f"\n{cfg.devices} devices, {args.steps} steps of {cfg.devices * cfg.batch_per_device} "
        "windows; bytes per device from the compiled HLO"
    )
    print(
        "| run | held-out loss | vs Adam | accuracy | total bytes / device | traffic vs Adam "
        "| largest reduction |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in RUNS:
        if name not in rows:
            continue
        r = rows[name]
        rel = f"{100 * (r['loss'] / adam['loss'] - 1):+.1f}%" if adam and name != "adam" else ""
        ratio = ""
        if adam and r["total_bytes"]:
            ratio = f"{adam['total_bytes'] / r['total_bytes']:,.0f}x less"
        if adam and name == "adam":
            ratio = "1x"
        print(
            f"| {name} | {r['loss']:.4f} | {rel} | {100 * r['accuracy']:.1f}% | "
            f"{r['total_bytes'] / 1e6:,.2f} MB | {ratio} | "
            f"{r['peak_reduction_bytes'] / 1e3:,.0f} KB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
