"""The README's compressor table: HLO wire ratio, error after one step, error of the average.

In one process on ``--devices`` simulated CPU devices, every compressor reduces the same random
data with ``jc.compressed_pmean``: a ``256 x 256`` fp32 leaf per device (PowerSGD sees the
matrix; the others its flat buffer). Step ``t`` on device ``j`` gets ``x = g + xi_{t,j}`` with a
fixed ``g ~ N(0, 1)`` (the "signal" a gradient keeps) and fresh ``xi ~ N(0, 1)``.

Columns:

* wire ratio: bytes per device of fp32 ``lax.pmean`` over the compressor's, both read from the
  compiled HLO (:func:`jaxcomm.inspect.wire_bytes`);
* one step: ``||out_1 - mean_1|| / ||mean_1||`` from a zero state;
* 100-step average: ``||avg_t out_t - avg_t mean_t|| / ||avg_t mean_t||`` with the state
  threaded (error feedback, where the compressor has it, is what drives this to 0);
* 1 Gbit/s speedup: from a JSON written by ``benchmarks/compressors_1gbit.py --json``.

Usage::

    python benchmarks/compressor_table.py [--steps 100] [--speed /tmp/bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: table row -> (label, the 1 Gbit/s benchmark's method name or None)
ROWS = {
    "onebit": ("`OneBit()`", "onebit"),
    "int8": ("`Quantize(bits=8)`", "int8"),
    "int8_ef": ("`Quantize(bits=8, error_feedback=True)`", "int8_ef"),
    "int4": ("`Quantize(bits=4)`", "int4"),
    "int4_ef": ("`Quantize(bits=4, error_feedback=True)`", "int4_ef"),
    "bf16": ("`Cast(jnp.bfloat16)`", "bf16"),
    "bf16_ef": ("`Cast(jnp.bfloat16, error_feedback=True)`", None),
    "fp16": ("`Cast(jnp.float16)`", "fp16"),
    "powersgd": ("`PowerSGD(rank=4)`", "powersgd"),
    "topk": ("`TopK(fraction=0.01)`", "topk"),
    "topk_0.1": ("`TopK(fraction=0.001)`", "topk_0.1"),
}


def make(name: str):
    import jax.numpy as jnp

    import jaxcomm as jc

    return {
        "onebit": lambda: jc.OneBit(),
        "int8": lambda: jc.Quantize(bits=8),
        "int8_ef": lambda: jc.Quantize(bits=8, error_feedback=True),
        "int4": lambda: jc.Quantize(bits=4),
        "int4_ef": lambda: jc.Quantize(bits=4, error_feedback=True),
        "bf16": lambda: jc.Cast(jnp.bfloat16),
        "bf16_ef": lambda: jc.Cast(jnp.bfloat16, error_feedback=True),
        "fp16": lambda: jc.Cast(jnp.float16),
        "powersgd": lambda: jc.PowerSGD(rank=4),
        "topk": lambda: jc.TopK(fraction=0.01),
        "topk_0.1": lambda: jc.TopK(fraction=0.001),
    }[name]()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--speed", help="JSON from benchmarks/compressors_1gbit.py --json")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.inspect import wire_bytes

    n = args.devices
    mesh = jax.make_mesh((n,), ("dp",), axis_types=(AxisType.Auto,))
    shape = (256, 256)
    rng = np.random.default_rng(0)
    signal = rng.normal(size=shape).astype(np.float32)
    data = [(signal + rng.normal(size=(n, *shape))).astype(np.float32) for _ in range(args.steps)]
    exact = [d.mean(0, dtype=np.float64) for d in data]
    exact_avg = np.mean(exact, axis=0)

    def sharded(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
        )

    fp32 = sharded(lambda x, s: (lax.pmean(x[0], "dp"), s))
    spec = jax.ShapeDtypeStruct((n, *shape), jnp.float32)
    fp32_bytes = wire_bytes(fp32.lower(spec, ()).compile().as_text())

    speed = {}
    if args.speed:
        speed = json.loads(Path(args.speed).read_text()).get("speedup", {})

    rows = []
    for name, (label, bench_name) in ROWS.items():
        comp = make(name)
        state = jc.init_state(comp, jax.ShapeDtypeStruct(shape, jnp.float32), axis_size=n)
        gstate = jc.stack_per_device(state, n)
        step = sharded(
            lambda x, s, comp=comp: jc.compressed_pmean(x[0], s, axis_name="dp", compressor=comp)
        )
        ratio = fp32_bytes / wire_bytes(step.lower(spec, gstate).compile().as_text())
        total = np.zeros(shape)
        one_step = None
        for t, x in enumerate(data):
            out, gstate = step(x, gstate)
            out = np.asarray(out, np.float64)
            if t == 0:
                one_step = np.linalg.norm(out - exact[0]) / np.linalg.norm(exact[0])
            total += out
        avg_err = np.linalg.norm(total / len(data) - exact_avg) / np.linalg.norm(exact_avg)
        rows.append(
            {
                "name": name,
                "label": label,
                "wire_ratio": ratio,
                "one_step_rel_error": float(one_step),
                "avg_rel_error": float(avg_err),
                "speedup_1gbit": speed.get(bench_name) if bench_name else None,
            }
        )
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)

    print(
        f"| compressor | wire ratio (HLO, {n} dev) | rel. error, 1 step | "
        f"rel. error of the {args.steps}-step average | speedup at 1 Gbit/s (2 proc) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        sp = f"{r['speedup_1gbit']:.2f}x" if r["speedup_1gbit"] else "-"
        print(
            f"| {r['label']} | {r['wire_ratio']:.2f}x | {r['one_step_rel_error']:.2e} | "
            f"{r['avg_rel_error']:.2e} | {sp} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
