"""One check to run on an NVIDIA GPU machine (under 8 minutes on 8 H100s at the default sizes).

It prints, with the XLA flags it ran under (``jc.xla_flags("gpu", combine_threshold_bytes=B)``
with ``B`` the bucket size, set before JAX starts):

1. **Stages**: compress and decompress throughput of OneBit (pack signs + scale + worker
   residual; unpack scaled signs) and int8 (blockwise absmax quantization; dequantization) on
   one device, as GB/s of bytes read plus written, against the device's copy bandwidth
   (``y = x + 1`` over the same buffer, read + write).
2. **Overlap**: ``benchmarks/overlap_gpu.py`` (bucketed OneBit mean inside a backward pass,
   with and without the latency-hiding flags), on every GPU present (needs >= 2).
3. **1-bit Adam against exact Adam**: ``jc.make_train_step`` with ``jc.onebit_adam`` (its
   compressed phase, after the freeze) and with an exact mean + ``optax.adam``, on an MLP data
   parallel over every GPU present: median step times, the wire bytes of both compiled steps,
   the share of collective bytes with compute scheduled inside their
   async window (read from the compiled schedule), and a correctness check: during 1-bit
   Adam's warm-up the two optimizers are the same algorithm, so their parameters must agree.

``--cpu`` runs the same code on 8 simulated CPU devices at small sizes (what the test suite
does, so the script cannot rot); CPU figures measure nothing about a GPU.

Usage::

    python benchmarks/gpu_check.py [--json OUT]           # on the GPU machine
    python benchmarks/gpu_check.py --cpu --small          # smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, str(p))

#: Sizes (default: one H100 node; small: the CPU test).
SIZES = {
    "default": dict(stage_mb=256, layers=16, width=4096, batch=64, bucket_mb=32, steps=20,
                    overlap=["--layers", "24", "--width", "4096", "--batch", "64",
                             "--bucket-mb", "16", "--repeats", "10"]),
    "small": dict(stage_mb=1, layers=3, width=64, batch=4, bucket_mb=0.01, steps=3,
                  overlap=["--layers", "2", "--width", "64", "--batch", "4",
                           "--bucket-mb", "0.01", "--repeats", "2"]),
}  # fmt: skip
FREEZE = 3  # 1-bit Adam's warm-up steps (exact Adam) before the compressed phase


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="8 simulated CPU devices (smoke run)")
    p.add_argument("--small", action="store_true", help="small sizes (the CPU test's)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per stage/step")
    p.add_argument("--skip-overlap", action="store_true", help="skip section 2")
    p.add_argument("--json", metavar="OUT")
    return p.parse_args(argv)


def setup_env(cpu: bool, bucket_bytes: int) -> str:
    """Sets the platform and ``XLA_FLAGS`` before JAX starts; returns the flags."""
    if cpu:  # before jaxcomm imports jax, which reads these once
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
        return os.environ.get("XLA_FLAGS", "")
    import jaxcomm as jc

    os.environ["XLA_FLAGS"] = jc.xla_flags("gpu", combine_threshold_bytes=bucket_bytes)
    return os.environ["XLA_FLAGS"]


def median_seconds(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# 1. Stages: (function, bytes read + written for n fp32 inputs).


def stage_functions(block: int = 2048) -> dict:
    """name -> (make_input(x), jitted stage, bytes moved for ``n`` input elements)."""
    import jax
    import jax.numpy as jnp

    from jaxcomm.compressors.quantize import quantize_blocks
    from jaxcomm.compressors.signs import pack_signs, scaled_signs

    def onebit_compress(x):
        scale = jnp.sqrt(jnp.sum(jnp.square(x))) / jnp.sqrt(float(x.size))
        error = x - scale * jnp.where(x >= 0, 1.0, -1.0)
        return pack_signs(x), scale, error

    def onebit_decompress(packed, scale):
        return scaled_signs(packed, scale)

    def int8_compress(x):
        return quantize_blocks(x.reshape(-1, block), 8)

    def int8_decompress(q, inv):
        return (q.astype(jnp.float32) * inv[:, None]).reshape(-1)

    def ident(x):
        return (x,)

    return {
        # name: (inputs from x, fn, bytes read + written for n fp32 elements)
        "copy (x + 1)": (ident, jax.jit(lambda x: x + 1.0), lambda n: 8 * n),
        "onebit compress": (ident, jax.jit(onebit_compress), lambda n: 4 * n + n // 8 + 4 * n),
        "onebit decompress": (
            lambda x: jax.jit(onebit_compress)(x)[:2],
            jax.jit(onebit_decompress),
            lambda n: n // 8 + 4 * n,
        ),
        "int8 compress": (ident, jax.jit(int8_compress), lambda n: 4 * n + n + 4 * (n // block)),
        "int8 decompress": (
            lambda x: jax.jit(int8_compress)(x),
            jax.jit(int8_decompress),
            lambda n: n + 4 * (n // block) + 4 * n,
        ),
    }


def run_stages(size_mb: float, repeats: int) -> list[dict]:
    import jax

    n = max(int(size_mb * 2**20 / 4) // 2048 * 2048, 2048)
    dev = jax.devices()[0]
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n,)), dev)
    rows = []
    for name, (inputs, fn, moved) in stage_functions().items():
        args = inputs(x)
        secs = median_seconds(fn, *args, repeats=repeats)
        rows.append(dict(stage=name, elements=n, seconds=secs, bytes=moved(n),
                         gbps=moved(n) / secs / 1e9))  # fmt: skip
    copy = rows[0]["gbps"]
    for r in rows:
        r["of_copy"] = r["gbps"] / copy
    return rows


# ---------------------------------------------------------------------------------------------
# 3. 1-bit Adam against exact Adam on every device present.


def mlp(layers: int, width: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), layers)
    params = {f"w{i:02d}": jax.random.normal(k, (width, width)) / width**0.5
              for i, k in enumerate(keys)}  # fmt: skip

    def loss(p, x):
        h = x
        for name in sorted(p):
            h = jax.nn.gelu(h.astype(jnp.bfloat16) @ p[name].astype(jnp.bfloat16))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return params, loss


def optimizers(bucket: int) -> dict:
    import optax

    import jaxcomm as jc

    return {
        "exact Adam": optax.chain(
            jc.compressed_mean("dp", jc.NoCompression(), bucket), optax.adam(1e-3)
        ),
        "1-bit Adam": jc.onebit_adam(1e-3, freeze_step=FREEZE, axis_name="dp", bucket_bytes=bucket),
    }


def run_steps(layers: int, width: int, batch: int, bucket: int, steps: int) -> dict:
    """Warm-up agreement, then median step time of each optimizer's steady phase."""
    import jax
    import numpy as np
    from aot_report import analyse

    import jaxcomm as jc

    devices = jax.devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    params, loss = mlp(layers, width)
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((n * batch, width), np.float32) for _ in range(4)]
    out: dict = {"devices": n, "platform": devices[0].platform, "device_kind":
                 devices[0].device_kind, "parameters": layers * width * width}  # fmt: skip
    warm: dict = {}
    for name, tx in optimizers(bucket).items():
        step, state = jc.make_train_step(mesh, "dp", loss, tx, params)
        for i in range(FREEZE):  # warm-up: identical algorithms
            state, _ = step(state, batches[i % len(batches)])
        warm[name] = jax.tree.map(np.asarray, jc.params_of(state))
        for i in range(2):  # into the steady (compressed) phase, compiled
            state, _ = step(state, batches[i % len(batches)])
        phases = step.phases(state, batches[0])
        placed = jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype, sharding=split)
        compiled = step.program(phases).lower(state, placed).compile()
        sched = analyse(compiled.as_text(), list(mesh.devices.flat))
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, lval = step(state, batches[i % len(batches)])
            jax.block_until_ready(lval)  # one step at a time: the step's own latency
            times.append(time.perf_counter() - t0)
        out[name] = dict(
            median_s=statistics.median(times), phases=list(phases),
            wire_bytes=sched["wire_bytes"], collectives=len(sched["collectives"]),
            async_pairs=sched["async_pairs"], overlap_fraction=sched["overlap_fraction"],
            loss=float(lval),
        )  # fmt: skip
    diffs = [
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(warm["exact Adam"]), jax.tree.leaves(warm["1-bit Adam"]),
                        strict=True)
    ]  # fmt: skip
    out["warmup_max_abs_diff"] = max(diffs)
    out["speedup"] = out["exact Adam"]["median_s"] / out["1-bit Adam"]["median_s"]
    return out


# ---------------------------------------------------------------------------------------------
# 2. Overlap: benchmarks/overlap_gpu.py in its own processes (it sets XLA_FLAGS per mode).


def run_overlap(extra: list[str], cpu: bool) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "overlap.json")
        cmd = [sys.executable, str(REPO / "benchmarks" / "overlap_gpu.py"), *extra, "--json", out]
        if cpu:
            cmd.append("--allow-cpu")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout.rstrip())
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            return {"error": f"overlap_gpu.py exited {proc.returncode}"}
        if not os.path.exists(out):
            return None  # skipped (fewer than 2 GPUs)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    args = _parse(argv)
    size = SIZES["small" if args.small else "default"]
    bucket = int(size["bucket_mb"] * 2**20)
    flags = setup_env(args.cpu, bucket)
    import jax

    import jaxcomm as jc

    devices = jax.devices()
    if not args.cpu and devices[0].platform != "gpu":
        print(f"no GPU: JAX sees {devices[0].platform} devices (use --cpu for a smoke run)")
        return 1
    repeats = args.repeats or (3 if args.small else 20)
    t_start = time.perf_counter()
    kind, platform = devices[0].device_kind, devices[0].platform
    print(f"{len(devices)} x {kind} ({platform}), jax {jax.__version__}")
    print(f"XLA_FLAGS={flags!r}")
    if args.cpu:
        gpu_flags = jc.xla_flags("gpu", combine_threshold_bytes=bucket)
        print(f"(the GPU run sets XLA_FLAGS={gpu_flags!r})")
    result: dict = {"xla_flags": flags, "devices": len(devices),
                    "device_kind": devices[0].device_kind, "sizes": size}  # fmt: skip

    print(f"\n1. compress / decompress on one device, {size['stage_mb']} MiB fp32 buffers")
    stages = run_stages(size["stage_mb"], repeats)
    print(f"{'stage':<20}{'ms':>10}{'GB/s':>10}{'of copy':>9}")
    for r in stages:
        print(f"{r['stage']:<20}{r['seconds'] * 1e3:>10.3f}{r['gbps']:>10.1f}{r['of_copy']:>9.0%}")
    result["stages"] = stages

    print("\n2. overlap of bucketed collectives with the backward pass (overlap_gpu.py)")
    result["overlap"] = None if args.skip_overlap else run_overlap(size["overlap"], args.cpu)

    print(f"\n3. 1-bit Adam against exact Adam, {size['layers']} x {size['width']}^2 MLP, "
          f"bucket {bucket} B, {len(devices)} devices")  # fmt: skip
    steps = run_steps(size["layers"], size["width"], size["batch"], bucket, size["steps"])
    print(f"{'optimizer':<12}{'phase':>14}{'step ms':>10}{'wire/dev':>12}{'async':>8}"
          f"{'overlap':>9}")  # fmt: skip
    for name in ("exact Adam", "1-bit Adam"):
        r = steps[name]
        ov = "-" if r["overlap_fraction"] is None else f"{r['overlap_fraction']:.0%}"
        print(f"{name:<12}{str(tuple(r['phases'])):>14}{r['median_s'] * 1e3:>10.2f}"
              f"{r['wire_bytes']:>12.0f}{str(r['async_pairs']) + '/' + str(r['collectives']):>8}"
              f"{ov:>9}")  # fmt: skip
    print(f"1-bit Adam speed-up over exact: {steps['speedup']:.2f}x; warm-up parameters agree "
          f"to {steps['warmup_max_abs_diff']:.2e}")  # fmt: skip
    if len(devices) < 2:
        print("(one device: collectives are no-ops, the step times show compression's cost only)")
    result["train_step"] = steps
    result["wall_s"] = time.perf_counter() - t_start
    print(f"\ntotal {result['wall_s']:.0f} s")
    if args.cpu:
        print("(CPU smoke run: these figures say nothing about a GPU)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
