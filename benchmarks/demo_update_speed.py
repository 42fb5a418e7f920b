"""A/B of ``jc.demo``'s cost on the CPU: this checkout against a base commit, in one process.

The base commit's ``jaxcomm`` is exported as ``jaxcomm_base`` (as in ``ab_train_step.py``) and
both versions run side by side on simulated CPU devices (``JAX_NUM_CPU_DEVICES=2``; 1 and 2
devices in the mesh), each through ``jc.make_train_step`` with ``jc.demo`` at its defaults:

* ``update``: a loss linear in the parameters (``sum(p * x)``: the gradient is the batch, no
  model compute), so the step is DeMo's update (DCT, top-k, coding, all-gather, decode);
* ``step``: the whole train step of a model.

Shapes: ``large``, the byte-level transformer of ``benchmarks/time_to_loss.py``'s ``large``
size (width 128, 4 layers, 863,232 parameters, 16 windows of 32 bytes per device), and
``mlp64``, the 64 MiB MLP of ``train_step_1gbit.py`` (4 x 2048 x 2048 + bias, 16 examples a
device). The timed rounds alternate base and new (order reversed every other round); a round
times ``--inner`` steps; medians over ``--repeats`` rounds and the ratio new / base.

``--check`` first runs both versions ``CHECK_STEPS`` steps from the same state on the same
batches (the large shapes and a 1024 x 512 leaf; fp32 and bf16 parameters, fp32 and bf16 wire
values, weight decay) and fails unless every update, parameter and state array is
bit-identical.

Usage::

    python benchmarks/demo_update_speed.py [--base HEAD] [--shapes large,mlp64] [--check]
                                           [--devices 1,2] [--repeats 9] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

CHECK_STEPS = 4
BATCH = 16


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against (HEAD)")
    p.add_argument("--shapes", default="large,mlp64")
    p.add_argument("--kinds", default="update,step")
    p.add_argument("--devices", default="1,2")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--inner", type=int, default=None, help="steps per timed round (by shape)")
    p.add_argument("--check", action="store_true", help="bit-identity check first")
    p.add_argument("--no-base", action="store_true", help="time this checkout only")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _model(shape: str, kind: str, n: int):
    """``(params, loss_fn, batch)`` with ``batch`` stacked for ``n`` devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcomm.cli.models import ByteBatches, ByteTransformer

    rng = np.random.default_rng(0)
    if shape == "large":
        model = ByteTransformer(width=128, heads=4, layers=4)
        params = model.init(0)
        if kind == "step":
            data = ByteBatches.from_corpus(context=model.context)
            return params, model.loss, data.sample(rng, (n * BATCH,))
    else:
        from _two_ranks import mlp

        params, loss_fn, local = mlp(2048, 4, BATCH, 0)
        if kind == "step":
            return params, loss_fn, tuple(np.concatenate([x] * n) for x in local)

    def linear(p, x):
        pairs = zip(jax.tree.leaves(p), jax.tree.leaves(x), strict=True)
        return sum(jnp.sum(a * jnp.mean(b, axis=0)) for a, b in pairs)

    grads = [
        rng.standard_normal((n, *np.shape(a))).astype(np.float32) for a in jax.tree.leaves(params)
    ]
    return params, linear, jax.tree.unflatten(jax.tree.structure(params), grads)


def _check(libs, n: int) -> list[str]:
    """Both versions ``CHECK_STEPS`` steps on the large shapes; the arrays that differ."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mesh = jax.make_mesh((n,), ("dp",), devices=jax.devices()[:n])
    bad = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for wire in (jnp.float32, jnp.bfloat16):
            params, loss_fn, _ = _model("large", "update", n)
            params["big"] = np.zeros((1024, 512), np.float32)  # 128 tiles: a leaf alone
            params = jax.tree.map(lambda a, dtype=dtype: jnp.asarray(a, dtype), params)
            results = []
            for lib in libs:
                tx = lib.demo(3e-3, axis_name="dp", weight_decay=0.1, value_dtype=wire)
                step, state = lib.make_train_step(mesh, "dp", loss_fn, tx, params)
                out = []
                for s in range(CHECK_STEPS):
                    rng = np.random.default_rng(100 + s)
                    batch = jax.tree.map(
                        lambda a, rng=rng: rng.standard_normal((n, *a.shape)).astype(np.float32),
                        params,
                    )
                    state, _ = step(state, batch)
                    out.append(jax.tree.map(np.asarray, state))
                results.append(jax.tree.leaves(out))
            for i, (a, b) in enumerate(zip(*results, strict=True)):
                if a.shape != b.shape or a.tobytes() != b.tobytes():
                    bad.append(f"{np.dtype(dtype).name} params, {np.dtype(wire).name} wire: #{i}")
    return bad


def main(argv=None) -> None:
    args = _parse(argv)
    from ab_train_step import BASE_NAME, export_base

    tmp = tempfile.mkdtemp(prefix="demo_ab_")
    commit = None
    if not args.no_base:
        commit = export_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
    import importlib

    import jax
    import numpy as np
    from _two_ranks import provenance

    import jaxcomm as jc

    libs = {"new": jc}
    if not args.no_base:
        libs = {"base": importlib.import_module(BASE_NAME), "new": jc}
    if args.check and not args.no_base:
        for n in (1, 2):
            bad = _check(list(libs.values()), n)
            print(f"bit-identity, {n} device(s): {'OK' if not bad else 'DIFFER ' + str(bad)}")
            if bad:
                sys.exit(1)

    rows = []
    for shape in [s for s in args.shapes.split(",") if s]:
        for kind in [k for k in args.kinds.split(",") if k]:
            for n in (int(d) for d in args.devices.split(",")):
                mesh = jax.make_mesh((n,), ("dp",), devices=jax.devices()[:n])
                params, loss_fn, batch = _model(shape, kind, n)
                batch = jc.train.place_batch(batch, mesh, "dp")  # on device once
                runs = {}
                for label, lib in libs.items():
                    tx = lib.demo(3e-3, axis_name="dp")
                    step, state = lib.make_train_step(mesh, "dp", loss_fn, tx, params)
                    for _ in range(3):
                        state, loss = step(state, batch)
                    jax.block_until_ready(state)
                    runs[label] = [step, state]
                inner = args.inner or (10 if shape == "large" else 2)
                times = {label: [] for label in runs}
                for r in range(args.repeats):
                    order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                    for label in order:
                        step, state = runs[label]
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            state, loss = step(state, batch)
                        jax.block_until_ready((state, loss))
                        times[label].append((time.perf_counter() - t0) / inner * 1e3)
                        runs[label][1] = state
                med = {label: statistics.median(t) for label, t in times.items()}
                row = {"shape": shape, "kind": kind, "devices": n, "ms": med, "all_ms": times}
                if "base" in med:
                    row["ratio"] = med["new"] / med["base"]
                rows.append(row)
                text = "  ".join(f"{k} {v:8.2f} ms" for k, v in med.items())
                ratio = f"  new/base {row['ratio']:.3f}" if "ratio" in row else ""
                print(f"{shape:6s} {kind:6s} {n} dev  {text}{ratio}", flush=True)
                del runs
    doc = {**provenance(base=commit or "none"), "rows": rows, "repeats": args.repeats}
    try:
        import subprocess

        doc["commit"] = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    _ = np


if __name__ == "__main__":
    main()
