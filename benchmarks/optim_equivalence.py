"""Bit-for-bit equivalence of the optimizers across two versions of jaxcomm.

Runs each optimizer below for a few steps on a small MLP over 8 simulated CPU devices (through
``jc.make_train_step``, phase-specialised and as one program), with a NaN in one device's batch
at one step (the skip), and saves every loss, parameter and optimizer-state leaf of every step.
Run it once per version, then compare the two files leaf by leaf with ``np.array_equal``::

    python benchmarks/optim_equivalence.py --save /tmp/before.npz --jaxcomm /tmp/old_checkout
    python benchmarks/optim_equivalence.py --save /tmp/after.npz
    python benchmarks/optim_equivalence.py --compare /tmp/before.npz /tmp/after.npz

``--jaxcomm DIR`` imports jaxcomm from ``DIR`` (a checkout of the other version).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

STEPS = 20
NAN_STEP = 13  # a compressed (or local) step in every schedule below


def optimizers(jc, optax, axis):
    """name -> transformation; warm-ups and freezes fall inside the 20 steps."""
    int8 = jc.Quantize(bits=8)
    return {
        "compressed_mean": optax.chain(jc.compressed_mean(axis, warmup_steps=5), optax.adam(1e-2)),
        "onebit_adam": jc.onebit_adam(1e-2, freeze_step=5, axis_name=axis),
        "onebit_adam_ds": jc.onebit_adam(
            1e-2, freeze_step=5, axis_name=axis, deepspeed_compat=True, weight_decay=1e-2
        ),
        "zero_one_adam": jc.zero_one_adam(1e-2, axis_name=axis, total_steps=STEPS,
                                          var_freeze_step=8, weight_decay=1e-2),
        "zero_one_adam_ds": jc.zero_one_adam(
            1e-2, axis_name=axis, var_freeze_step=8, var_update_scaler=2, local_step_scaler=2,
            deepspeed_compat=True,
        ),
        "zero_one_adam_buckets": jc.zero_one_adam(
            1e-2, axis_name=axis, total_steps=STEPS, var_freeze_step=8, bucket_bytes=1
        ),
        "onebit_lamb": jc.onebit_lamb(1e-2, freeze_step=5, axis_name=axis, weight_decay=1e-2),
        "onebit_lamb_buckets": jc.onebit_lamb(1e-2, freeze_step=5, axis_name=axis, bucket_bytes=1),
        "onebit_lamb_pre": jc.onebit_lamb(
            1e-2, freeze_step=5, axis_name=axis, precondition=True, bias_correction=True
        ),
        "sharded_int8": jc.sharded(optax.adam(1e-2), axis, compressor=int8, gather_compressor=int8),
        "sharded_onebit": jc.sharded(optax.adamw(1e-2), axis, compressor=jc.OneBit()),
        "demo": jc.demo(1e-3, axis_name=axis, top_k=4, chunk_size=8, weight_decay=1e-2),
        # The staged codecs with error feedback, in one program and around host exchanges.
        "compressed_mean_int4_ef": optax.chain(
            jc.compressed_mean(axis, jc.Quantize(bits=4, block_size=8, error_feedback=True)),
            optax.adam(1e-2),
        ),
        "compressed_mean_bf16_ef": optax.chain(
            jc.compressed_mean(axis, jc.Cast(error_feedback=True)), optax.adam(1e-2)
        ),
        **{
            f"diloco_{name}{'_background' if background else ''}": jc.diloco(
                optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True), 4, axis,
                compressor=comp, overlap_steps=2, background=background,
            )
            for name, comp in (
                ("exact", None),
                ("onebit", jc.OneBit()),
                ("int4", jc.Quantize(bits=4, block_size=8, error_feedback=True)),
                ("bf16", jc.Cast(error_feedback=True)),
            )
            for background in (False, True)
        },
    }


def run_all(only: list[str] | None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxcomm as jc

    print("jaxcomm from", os.path.dirname(jc.__file__), flush=True)
    n = 8
    mesh = jax.make_mesh((n,), ("dp",))
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(16, 32)).astype(np.float32) * 0.3,
        "b1": np.zeros(32, np.float32),
        "w2": rng.normal(size=(32, 4)).astype(np.float32) * 0.3,
    }

    def loss_fn(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    batches = []
    for t in range(STEPS):
        x = rng.normal(size=(n * 4, 16)).astype(np.float32)
        y = rng.normal(size=(n * 4, 4)).astype(np.float32)
        if t == NAN_STEP:
            x[5, 3] = np.nan  # device 1's batch
        batches.append((x, y))

    out = {}
    for name, tx in optimizers(jc, optax, "dp").items():
        if only and name not in only:
            continue
        for phased in (True, False):
            key = f"{name}/{'phased' if phased else 'single'}"
            step, state = jc.make_train_step(
                mesh, "dp", loss_fn, tx, params, specialize_phases=phased
            )
            for t, batch in enumerate(batches):
                state, loss = step(state, batch)
                out[f"{key}/{t}/loss"] = np.asarray(loss)
                leaves = jax.tree_util.tree_leaves_with_path(state)
                for path, leaf in leaves:
                    out[f"{key}/{t}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
            print(key, "final loss", float(loss), flush=True)
    return out


def renamed(key: str, renames: list[tuple[str, str]]) -> str:
    """``key`` with each state field renamed (``.old`` -> ``.new``, whole path parts only)."""
    for old, new in renames:
        key = re.sub(re.escape(old) + r"(?=[.\[]|$)", new, key)
    return key


def compare(a_path: str, b_path: str, renames: list[tuple[str, str]] = ()) -> int:
    import numpy as np

    a_npz, b = np.load(a_path), np.load(b_path)
    a = {renamed(k, list(renames)): a_npz[k] for k in a_npz.files}
    missing = sorted(set(a) ^ set(b.files))
    bad = [k for k in sorted(set(a) & set(b.files))
           if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or not np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind in "fc")]
    print(f"{len(a)} vs {len(b.files)} arrays; {len(missing)} in one file only; "
          f"{len(bad)} differ")
    for k in (missing + bad)[:30]:
        print("  ", k)
    return 1 if missing or bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", metavar="NPZ")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    parser.add_argument("--jaxcomm", metavar="DIR", help="import jaxcomm from this checkout")
    parser.add_argument("--only", default="", help="comma-separated optimizer names")
    parser.add_argument(
        "--rename", action="append", default=[], metavar="OLD=NEW",
        help="a state field renamed between A and B (e.g. .skipped_total=.skips.total)",
    )
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, [tuple(r.split("=", 1)) for r in args.rename])
    if not args.save:
        parser.error("give --save NPZ or --compare A B")
    if args.jaxcomm:
        sys.path.insert(0, os.path.abspath(args.jaxcomm))
    import numpy as np

    only = [s for s in args.only.split(",") if s]
    np.savez(args.save, **run_all(only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
