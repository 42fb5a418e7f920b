"""fp32 ``lax.pmean`` vs every compressor's ``jc.compressed_pmean``, 2 processes, 1 Gbit/s link.

Two processes (one CPU device each, gloo collectives over TCP), each in its own network namespace,
joined by a full-duplex link shaped with ``tc tbf`` to ``--rate`` each way (``duplex.sh`` via
``benchmarks/_two_ranks.py``; ``--topo lo``: one shaped loopback for both directions, the earlier
setup), which stands in for a slow cluster interconnect. Each reduces ``--size-mb`` of fp32 per
process inside ``jax.shard_map`` over the 2-device global mesh, once with ``lax.pmean`` and once per
compressor with ``jc.compressed_pmean(..., compressor=c)`` (``--methods`` picks them; all by
default).

Timing: 2 warm-up calls per method, then ``--repeats`` rounds that time one call of every
method in turn (so load bursts on a shared machine hit all methods alike), each call preceded
by a barrier (a tiny cross-process psum, timed too) so that both ranks start together; a
call's time is the slower rank's, and the table shows medians. Bytes on the wire per device
are read from the compiled HLO (:func:`jaxcomm.inspect.wire_bytes`).

Usage (root, for duplex.sh's namespaces and ``tc``; ``--no-shape`` runs on the unshaped
loopback)::

    python benchmarks/compressors_1gbit.py [--size-mb 64] [--rate 1gbit] [--topo auto|lo]
                                           [--repeats 5]
                                           [--methods onebit,int8,...] [--no-shape] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

WARMUP = 2

#: name -> (compressor as written in user code, end-to-end speedup target vs fp32 pmean).
METHODS = {
    "onebit": ("jc.OneBit()", 8.0),
    "onebit_noguard": ("jc.OneBit().all_reduce, no non-finite guard", None),
    "int8": ("jc.Quantize(bits=8)", 3.0),
    "int8_ef": ("jc.Quantize(bits=8, error_feedback=True)", 3.0),
    "int4": ("jc.Quantize(bits=4)", 4.0),
    "int4_ef": ("jc.Quantize(bits=4, error_feedback=True)", 4.0),
    "bf16": ("jc.Cast(jnp.bfloat16)", 1.7),
    "fp16": ("jc.Cast(jnp.float16)", 1.7),
    "powersgd": ("jc.PowerSGD(rank=4), buffer as a square matrix", None),
    "topk": ("jc.TopK(fraction=0.01)", None),
    "topk_0.1": ("jc.TopK(fraction=0.001)", None),
}


def make_compressor(name: str):
    """The compressor of ``METHODS[name]``."""
    import jax.numpy as jnp

    import jaxcomm as jc

    if name not in METHODS:
        raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    factories = {
        "onebit": lambda: jc.OneBit(),
        "onebit_noguard": lambda: jc.OneBit(),
        "int8": lambda: jc.Quantize(bits=8),
        "int8_ef": lambda: jc.Quantize(bits=8, error_feedback=True),
        "int4": lambda: jc.Quantize(bits=4),
        "int4_ef": lambda: jc.Quantize(bits=4, error_feedback=True),
        "bf16": lambda: jc.Cast(jnp.bfloat16),
        "fp16": lambda: jc.Cast(jnp.float16),
        "powersgd": lambda: jc.PowerSGD(rank=4),
        "topk": lambda: jc.TopK(fraction=0.01),
        "topk_0.1": lambda: jc.TopK(fraction=0.001),
    }
    comp = factories[name]()
    return comp


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from _two_ranks import two_rank_parser

    p = two_rank_parser(__doc__, methods=METHODS, repeats_help="timed runs per method")
    p.add_argument("--size-mb", type=float, default=64.0, help="fp32 MiB per process (64)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Worker (one per rank).
# --------------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    from _two_ranks import barrier as make_barrier
    from _two_ranks import finish_worker, start_gloo

    rank, n, mesh = start_gloo()  # before JAX is imported: one CPU device per process
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.inspect import wire_bytes

    sharded = NamedSharding(mesh, P("dp"))
    numel = int(args.size_mb * 2**20) // 4

    def to_global(x):
        return jax.make_array_from_process_local_data(sharded, np.asarray(x))

    x = to_global(np.random.default_rng(rank).standard_normal(numel, dtype=np.float32))
    names = [m for m in args.methods.split(",") if m]

    def smap(fn, in_specs, out_specs, donate=()):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True),
            donate_argnums=donate,
        )

    # Every method donates its input, as a training step can donate its gradients (and its error
    # feedback): outputs then reuse input buffers instead of fresh 64 MiB allocations. The state
    # comes first, in and out: JAX pairs each output with a donated input of its shape in order,
    # and with the mean first it took the worker residual's buffer, so XLA copied the residual
    # (64 MiB) for the guard's read of it (measured: the guard cost 7-12% that way, 2% without).
    fp32 = smap(lambda v: lax.pmean(v, "dp"), P("dp"), P(), donate=(0,))
    barrier = make_barrier(mesh)

    fresh_copy = jax.jit(jnp.copy)
    wire = {"fp32": wire_bytes(fp32.lower(x).compile().as_text())}
    runners = {"fp32": lambda v: fp32(v).block_until_ready()}
    for name in names:
        comp = make_compressor(name)
        # PowerSGD views leaves as matrices: the buffer is reduced as one square-ish matrix.
        rows = 2 ** (int(np.log2(numel)) // 2) if name == "powersgd" else numel
        shape = (rows, numel // rows) if name == "powersgd" else (numel,)
        state = jax.tree.map(
            lambda s: to_global(np.asarray(s)),
            jc.init_state(comp, jax.ShapeDtypeStruct(shape, jnp.float32), axis_size=n),
        )

        def body(s, v, comp=comp, shape=shape):
            out, s = jc.compressed_pmean(v.reshape(shape), s, axis_name="dp", compressor=comp)
            return s, out.reshape(-1)

        if name == "onebit_noguard":  # the compressor's own all-reduce: what the guard costs

            def body(s, v, comp=comp):
                out, bucket = comp.all_reduce(v, s.buckets[0], axis_name="dp", axis_size=n)
                return s._replace(buckets=(bucket,)), out

        fn = smap(body, (P("dp"), P("dp")), (P("dp"), P()), donate=(0, 1))
        wire[name] = wire_bytes(fn.lower(state, x).compile().as_text())
        holder = {"state": state}

        def run(v, fn=fn, holder=holder):
            holder["state"], out = fn(holder["state"], v)
            jax.block_until_ready((out, holder["state"]))

        runners[name] = run

    times: dict[str, list[float]] = {name: [] for name in runners}
    times["barrier"] = []
    for fn in runners.values():
        for _ in range(WARMUP):
            v = fresh_copy(x).block_until_ready()
            barrier()
            fn(v)
    # Rounds visit every method in turn, so a burst of load on this shared machine hits all
    # methods alike instead of skewing one.
    for _ in range(args.repeats):
        for name, fn in runners.items():
            v = fresh_copy(x).block_until_ready()  # outside the timer: it is donated
            times["barrier"].append(barrier())
            t0 = time.perf_counter()
            fn(v)
            times[name].append(time.perf_counter() - t0)
    for name in runners:
        print(f"rank {rank} {name}: {[round(t, 4) for t in times[name]]}", flush=True)

    result = {"rank": rank, "num_processes": n, "numel": numel, "times": times, "wire": wire}
    finish_worker(args, rank, result, barrier)


# --------------------------------------------------------------------------------------------
# Launcher side.
# --------------------------------------------------------------------------------------------


def _summarize(ranks: list[dict], args: argparse.Namespace, shaped: bool) -> dict:
    def slowest_median(name: str) -> float:
        # A collective is done when its slowest participant is.
        per_run = [max(r["times"][name][i] for r in ranks) for i in range(args.repeats)]
        return statistics.median(per_run)

    names = [k for k in ranks[0]["times"] if k != "barrier"]
    medians = {name: slowest_median(name) for name in names}
    wire = ranks[0]["wire"]
    guard = None
    if "onebit" in names and "onebit_noguard" in names:
        # Paired: the two run back to back in every round, so the ratio of each round cancels
        # the load drifts that move a median of either by several percent on this machine.
        ratios = [
            max(r["times"]["onebit"][i] for r in ranks)
            / max(r["times"]["onebit_noguard"][i] for r in ranks)
            for i in range(args.repeats)
        ]
        guard = statistics.median(ratios) - 1
    return {
        "size_mb": args.size_mb,
        "numel": ranks[0]["numel"],
        "num_processes": ranks[0]["num_processes"],
        "rate": args.rate if shaped else None,
        "repeats": args.repeats,
        "median_s": medians,
        "barrier_median_s": slowest_median("barrier"),
        "speedup": {k: medians["fp32"] / medians[k] for k in names},
        "wire_bytes_per_device": wire,
        "wire_ratio": {k: wire["fp32"] / max(wire[k], 1) for k in names},
        "times_s": {r["rank"]: r["times"] for r in ranks},
        "guard_cost": guard,
    }


def _table(s: dict) -> str:
    link = s["rate"] or "unshaped loopback"
    w = s["wire_bytes_per_device"]
    rows = [
        f"{s['num_processes']} processes x {s['size_mb']:g} MiB fp32, link: {link}, "
        f"median of {s['repeats']} (barrier {s['barrier_median_s'] * 1e3:.1f} ms)",
        f"{'method':<50}{'median (s)':>11}{'wire/device':>14}{'wire x':>8}{'speedup':>9}"
        f"{'target':>8}",
    ]
    for name, median in s["median_s"].items():
        label, target = ("fp32 lax.pmean", None) if name == "fp32" else METHODS[name]
        tgt = f">={target:g}x" if target else ""
        rows.append(
            f"{label:<50}{median:>11.4f}{w[name] / 2**20:>10.2f} MiB{s['wire_ratio'][name]:>7.2f}x"
            f"{s['speedup'][name]:>8.2f}x{tgt:>8}"
        )
    if s["guard_cost"] is not None:
        rows.append(
            f"non-finite guard: {s['guard_cost']:+.1%} of the OneBit op (median of the per-round "
            "ratios jc.OneBit() / no guard, slower rank; target <= 5%)"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0

    from _two_ranks import report_two_ranks

    return report_two_ranks(
        __file__, argv, args, prefix="jaxcomm-bench-", summarize=_summarize, table=_table
    )


if __name__ == "__main__":
    sys.exit(main())
