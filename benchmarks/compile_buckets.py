"""Compile time and peak memory of ``jc.compressed_pmean`` over a 300-leaf tree, per compressor.

One process, 8 simulated CPU devices; the tree has 300 leaves (every third a 256 B vector, the
others 8 KiB matrices), reduced with ``--bucket-bytes`` (16 KiB: 150 buckets). Each compressor
compiles in a fresh process (peak RSS is the process's); prints compile seconds, peak GB, the
compiled HLO size and its ``is-finite`` count (the non-finite guard's checks: linear in buckets).

Usage::

    python benchmarks/compile_buckets.py [--bucket-bytes 16384] [--compressors onebit,int8_ef,...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

FACTORIES = {
    "onebit": "jc.OneBit()",
    "int8": "jc.Quantize(bits=8)",
    "int8_ef": "jc.Quantize(bits=8, error_feedback=True)",
    "powersgd": "jc.PowerSGD(rank=4)",
    "topk": "jc.TopK(fraction=0.01)",
    "bf16": "jc.Cast(jnp.bfloat16)",
    "none": "jc.NoCompression()",
}


def _one(name: str, bucket_bytes: int | None) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import resource

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    comp = eval(FACTORIES[name], {"jc": jc, "jnp": jnp})  # noqa: S307 - fixed table above
    shapes = [(32, 64) if i % 3 else (64,) for i in range(300)]
    local = {f"p{i:03d}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    state = jc.init_state(comp, local, axis_size=8, bucket_bytes=bucket_bytes)

    def body(t, s):
        return jc.compressed_pmean(t, s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )

    def glob(x):
        return jax.ShapeDtypeStruct((8 * x.shape[0], *x.shape[1:]), x.dtype)

    t0 = time.perf_counter()
    text = fn.lower(jax.tree.map(glob, local), jax.tree.map(glob, state)).compile().as_text()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    buckets = len(jc.init_state(jc.OneBit(), local, axis_size=8, bucket_bytes=bucket_bytes).buckets)
    print(
        f"{FACTORIES[name]:<42}{buckets:>8}{seconds:>10.1f}{peak:>10.2f}"
        f"{len(text) / 1e6:>10.2f}{text.count('is-finite('):>10}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bucket-bytes", type=int, default=16384, help="bucket size (16384)")
    p.add_argument("--compressors", default=",".join(FACTORIES), help=",".join(FACTORIES))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per compressor (300)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        _one(args.one, args.bucket_bytes)
        return 0
    print(
        f"{'compressor':<42}{'buckets':>8}{'compile s':>10}{'peak GB':>10}{'HLO M':>10}"
        f"{'is-finite':>10}"
    )
    for name in args.compressors.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--bucket-bytes", str(args.bucket_bytes)]
        try:
            subprocess.run(cmd, check=True, timeout=args.timeout)
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
            print(f"{FACTORIES[name]:<42}  failed: {err}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
