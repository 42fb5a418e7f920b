"""Overlap of bucketed compressed all-reduce with the backward pass, on >= 2 GPUs.

A data-parallel MLP step (``--layers`` square layers of ``--width``) computes gradients and
reduces them with ``jc.compressed_pmean(..., compressor=jc.OneBit(), bucket_bytes=B)``: one
independent collective chain per bucket, so XLA may start a bucket's communication while the
backward pass still computes the earlier layers' gradients. Whether it does is up to its
scheduler, which :func:`jaxcomm.xla_flags` configures. The benchmark runs the same program in two
fresh processes (XLA reads ``XLA_FLAGS`` once):

* ``overlap``: ``jc.xla_flags("gpu", combine_threshold_bytes=B)``;
* ``serial``: ``jc.xla_flags("gpu", latency_hiding=False, pipelined=False)`` with the same
  combine threshold.

Each reports the median time of the full step, of the step without communication (compute
only) and of the reduction alone (communication only), and the overlap
``(compute + comm - step) / min(compute, comm)``: 0 when nothing overlaps, 1 when the shorter
part is completely hidden.

Needs >= 2 GPUs (collectives over one device are no-ops): elsewhere it prints ``SKIP`` and
exits 0. ``--allow-cpu`` runs the code path on simulated CPU devices (XLA's CPU collectives are
synchronous: expect no overlap; a smoke test only).

Usage::

    python benchmarks/overlap_gpu.py [--layers 24] [--width 4096] [--batch 64]
                                     [--bucket-mb 16] [--repeats 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64, help="rows per device")
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--allow-cpu", action="store_true", help="smoke-run on 8 simulated CPUs")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--child", choices=("overlap", "serial"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _median_time(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    devices = jax.devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    comp = jc.OneBit()
    bucket = int(args.bucket_mb * 2**20)
    dtype = jnp.float32 if args.allow_cpu else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), args.layers)
    params = [
        jax.random.normal(k, (args.width, args.width), dtype) / np.sqrt(args.width) for k in keys
    ]
    batch = jax.random.normal(jax.random.key(1), (n * args.batch, args.width), dtype)
    state = jc.init_state(comp, params, axis_size=n, bucket_bytes=bucket)
    rep = NamedSharding(mesh, P())
    params = jax.device_put(params, rep)
    batch = jax.device_put(batch, NamedSharding(mesh, P("dp")))
    state = jax.device_put(jc.stack_per_device(state, n), NamedSharding(mesh, P("dp")))

    def loss(ps, x):
        for w in ps:
            x = jax.nn.gelu(x @ w)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    def step(ps, x, s):
        grads = jax.grad(loss)(ps, x)
        grads, s = jc.compressed_pmean(grads, s, axis_name="dp", compressor=comp,
                                       bucket_bytes=bucket)  # fmt: skip
        return [w - 1e-3 * g.astype(w.dtype) for w, g in zip(ps, grads, strict=True)], s

    def compute_only(ps, x, s):
        grads = jax.grad(loss)(ps, x)
        return [w - 1e-3 * g.astype(w.dtype) for w, g in zip(ps, grads, strict=True)], s

    def comm_only(ps, x, s):
        grads, s = jc.compressed_pmean(ps, s, axis_name="dp", compressor=comp, bucket_bytes=bucket)
        return grads, s

    def smap(fn):
        return jax.jit(
            jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=(P(), P("dp"), P("dp")),
                out_specs=(P(), P("dp")),
                check_vma=False,  # replicated params, per-device grads: the usual DP step
            )
        )

    full, comp_fn, comm_fn = smap(step), smap(compute_only), smap(comm_only)
    report = jc.comms_report(full, params, batch, state, expect="uint8")
    t = {
        name: _median_time(fn, params, batch, state, repeats=args.repeats)
        for name, fn in (("step", full), ("compute", comp_fn), ("comm", comm_fn))
    }
    hidden = t["compute"] + t["comm"] - t["step"]
    return {
        "mode": args.child,
        "devices": n,
        "platform": devices[0].platform,
        "median_s": t,
        "overlap": max(0.0, hidden) / min(t["compute"], t["comm"]),
        "buckets": len(state.buckets),
        "wire_bytes": report.wire_bytes,
        "report": str(report),
    }


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child:
        if args.allow_cpu:
            import jax

            jax.config.update("jax_num_cpu_devices", 8)
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return 0

    import jaxcomm as jc

    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"],
        capture_output=True,
        text=True,
    )
    gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    if gpus < 2 and not args.allow_cpu:
        print(f"SKIP: needs >= 2 GPUs, found {gpus} (collectives over one device are no-ops)")
        return 0
    bucket = int(args.bucket_mb * 2**20)
    flags = {
        "overlap": jc.xla_flags("gpu", combine_threshold_bytes=bucket, base=""),
        "serial": jc.xla_flags(
            "gpu", latency_hiding=False, pipelined=False, combine_threshold_bytes=bucket, base=""
        ),
    }
    results = {}
    for mode, xla in flags.items():
        env = dict(os.environ)
        env["XLA_FLAGS"] = "" if args.allow_cpu else xla  # CPU: the GPU flags change nothing
        if args.allow_cpu:
            env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
        proc = subprocess.run([*cmd, "--child", mode], env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            return 1
        results[mode] = json.loads(lines[-1][len("RESULT ") :])
    print(results["overlap"]["report"])
    print(
        f"\n{results['overlap']['devices']} {results['overlap']['platform']} devices, "
        f"{args.layers} x {args.width}^2 layers, {results['overlap']['buckets']} buckets"
    )
    print(f"{'mode':<10}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'overlap':>9}")
    for mode, r in results.items():
        t = r["median_s"]
        print(
            f"{mode:<10}{t['step'] * 1e3:>10.2f}{t['compute'] * 1e3:>12.2f}"
            f"{t['comm'] * 1e3:>10.2f}{r['overlap']:>9.2f}"
        )
    speedup = results["serial"]["median_s"]["step"] / results["overlap"]["median_s"]["step"]
    print(f"step speedup from the overlap flags: {speedup:.2f}x")
    if results["overlap"]["platform"] == "cpu":
        print("(CPU smoke run: simulated devices share the cores and XLA's CPU collectives are")
        print(" synchronous, so these numbers do not measure overlap)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
