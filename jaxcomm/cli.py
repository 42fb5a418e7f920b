"""The ``jaxcomm`` command line.

``jaxcomm bench``: compressed vs exact all-reduce on simulated (or real) devices in one process:
for each size and compressor, the median time of a jitted ``compressed_pmean``, the bytes each
device sends (read from the compiled HLO), the wire ratio against an fp32 ``pmean``, and the
error of one compressed step against the exact mean. It is the quickest check that jaxcomm works
on a machine and what it saves; multi-process and shaped-network runs are in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

COMPRESSORS = ("none", "onebit")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxcomm", description="jaxcomm tools")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="compressed vs exact pmean: time, bytes on the wire (HLO), error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8)")
    bench.add_argument(
        "--sizes",
        default="4096,262144,4194304",
        help="comma-separated fp32 elements per device (4096,262144,4194304)",
    )
    bench.add_argument(
        "--compressors", default=",".join(COMPRESSORS), help="comma-separated: none,onebit"
    )
    bench.add_argument("--repeats", type=int, default=5, help="timed runs per row (5)")
    bench.add_argument(
        "--feedback-steps",
        type=int,
        default=20,
        help="steps on the same data; 'err avg' is the error of their average (20)",
    )
    bench.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    return parser.parse_args(argv)


def _compressor(name: str):
    import jaxcomm as jc

    if name == "none":
        return jc.NoCompression()
    if name == "onebit":
        return jc.OneBit()
    raise SystemExit(f"jaxcomm bench: unknown compressor {name!r} (choose from {COMPRESSORS})")


def _bench(args: argparse.Namespace) -> int:
    import jax

    # Simulated devices must be requested before jax initializes its CPU backend.
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.hlo import wire_bytes

    n = min(args.devices, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("dp",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, P("dp"))
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        data = np.random.default_rng(0).normal(size=(n, size)).astype(np.float32)
        exact_mean = data.mean(0)
        x = jax.device_put(data.reshape(-1), sharded)
        fp32_wire = None
        for name in args.compressors.split(","):
            comp = _compressor(name)
            local = jax.ShapeDtypeStruct((size,), jnp.float32)
            state = jc.init_state(comp, local, axis_size=n)
            state = jax.device_put(jax.tree.map(lambda s: jnp.concatenate([s] * n), state), sharded)

            def body(t, s, comp=comp):
                return jc.compressed_pmean(t, s, axis_name="dp", compressor=comp)

            fn = jax.jit(
                jax.shard_map(
                    body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp"))
                )
            )
            wire = wire_bytes(fn.lower(x, state).compile().as_text())
            # One step's error, and that of the average over steps: error feedback makes the
            # compressed stream unbiased over time even where one step is coarse.
            total, step_state = 0.0, state
            for step in range(args.feedback_steps):
                out, step_state = fn(x, step_state)
                total = total + np.asarray(out)
                if step == 0:
                    err = _rel_error(total, exact_mean)
            avg_err = _rel_error(total / args.feedback_steps, exact_mean)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn(x, state))
                times.append(time.perf_counter() - start)
            if name == "none":
                fp32_wire = wire
            rows.append(
                dict(
                    elements=size,
                    compressor=name,
                    median_ms=1e3 * statistics.median(times),
                    wire_bytes=wire,
                    wire_ratio=(fp32_wire / wire) if fp32_wire and wire else None,
                    rel_error=err,
                    rel_error_avg=avg_err,
                )
            )
    _print_rows(rows, n)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": n, "rows": rows}, f, indent=2)
    return 0


def _rel_error(got, want) -> float:
    import numpy as np

    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _print_rows(rows: list[dict], n: int) -> None:
    print(f"compressed_pmean on {n} devices (fp32 elements per device; bytes per device from HLO)")
    header = f"{'elements':>10} {'compressor':>10} {'median ms':>10} {'wire bytes':>12}"
    print(header + f" {'vs fp32':>8} {'err 1 step':>10} {'err avg':>10}")
    for r in rows:
        ratio = f"{r['wire_ratio']:.1f}x" if r["wire_ratio"] else "-"
        print(
            f"{r['elements']:>10} {r['compressor']:>10} {r['median_ms']:>10.2f} "
            f"{r['wire_bytes']:>12.0f} {ratio:>8} {r['rel_error']:>10.3g} "
            f"{r['rel_error_avg']:>10.3g}"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command == "bench":
        return _bench(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
