"""fp32 ``lax.pmean`` vs 1-bit ``jc.compressed_pmean`` between 2 processes on a 1 Gbit/s link.

Two processes (one CPU device each, gloo collectives over TCP) run in a private network
namespace whose loopback is shaped with ``tc tbf`` to ``--rate``, which stands in for a slow
cluster interconnect. Each reduces ``--size-mb`` of fp32 per process inside ``jax.shard_map``
over the 2-device global mesh, once with ``lax.pmean`` and once with
``jc.compressed_pmean(..., compressor=jc.OneBit())``.

Timing: 2 warm-up calls, then ``--repeats`` timed calls, each preceded by a barrier (a tiny
cross-process psum, timed too) so that both ranks start together; a call's time is the slower
rank's, and the table shows medians. Bytes on the wire per device are read from the compiled
HLO (:func:`jaxcomm.hlo.wire_bytes`).

Usage (needs root for ``unshare``/``tc``; ``--no-shape`` runs on the unshaped loopback)::

    python benchmarks/onebit_1gbit.py [--size-mb 64] [--rate 1gbit] [--repeats 5]
                                      [--no-shape] [--json OUT]
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

WARMUP = 2
TARGET_RATIO = 8.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=float, default=64.0, help="fp32 MiB per process (64)")
    p.add_argument("--rate", default="1gbit", help="tc rate of the shaped loopback (1gbit)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method (5)")
    p.add_argument("--no-shape", action="store_true", help="run on the unshaped loopback")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Worker (one per rank).
# --------------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.distributed import init_distributed
    from jaxcomm.hlo import wire_bytes

    info = init_distributed("gloo", initialization_timeout=120)
    rank, n = info.process_id, info.num_processes
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    sharded = NamedSharding(mesh, P("dp"))
    numel = int(args.size_mb * 2**20) // 4

    def to_global(x):
        return jax.make_array_from_process_local_data(sharded, np.asarray(x))

    x = to_global(np.random.default_rng(rank).standard_normal(numel, dtype=np.float32))
    comp = jc.OneBit()
    state = jax.tree.map(
        lambda s: to_global(np.asarray(s)),
        jc.init_state(comp, jax.ShapeDtypeStruct((numel,), jnp.float32), axis_size=n),
    )

    def smap(fn, in_specs, out_specs, donate=()):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True),
            donate_argnums=donate,
        )

    # Both methods donate their input, as a training step can donate its gradients (and 1-bit
    # its error feedback): outputs then reuse input buffers instead of fresh 64 MiB allocations.
    fp32 = smap(lambda v: lax.pmean(v, "dp"), P("dp"), P(), donate=(0,))
    onebit = smap(
        lambda v, s: jc.compressed_pmean(v, s, axis_name="dp", compressor=comp),
        (P("dp"), P("dp")),
        (P(), P("dp")),
        donate=(0, 1),
    )
    token = to_global(np.ones((1,), np.float32))
    barrier_fn = smap(lambda t: lax.psum(t, "dp"), P("dp"), P())

    def barrier() -> float:
        t0 = time.perf_counter()
        barrier_fn(token).block_until_ready()
        return time.perf_counter() - t0

    wire = {
        "fp32": wire_bytes(fp32.lower(x).compile().as_text()),
        "onebit": wire_bytes(onebit.lower(x, state).compile().as_text()),
    }

    fresh_copy = jax.jit(jnp.copy)

    def run_fp32(v):
        fp32(v).block_until_ready()

    def run_onebit(v):
        nonlocal state
        out, state = onebit(v, state)
        jax.block_until_ready((out, state))

    times: dict[str, list[float]] = {"fp32": [], "onebit": [], "barrier": []}
    for name, fn in (("fp32", run_fp32), ("onebit", run_onebit)):
        for _ in range(WARMUP):
            v = fresh_copy(x).block_until_ready()
            barrier()
            fn(v)
        for _ in range(args.repeats):
            v = fresh_copy(x).block_until_ready()  # outside the timer: it is donated
            times["barrier"].append(barrier())
            t0 = time.perf_counter()
            fn(v)
            times[name].append(time.perf_counter() - t0)
        print(f"{name}: {[round(t, 4) for t in times[name]]}", flush=True)

    result = {"rank": rank, "num_processes": n, "numel": numel, "times": times, "wire": wire}
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(result))
    barrier()
    jax.distributed.shutdown()


# --------------------------------------------------------------------------------------------
# Launcher side.
# --------------------------------------------------------------------------------------------


def _summarize(ranks: list[dict], args: argparse.Namespace, shaped: bool) -> dict:
    def slowest_median(name: str) -> float:
        # A collective is done when its slowest participant is.
        per_run = [max(r["times"][name][i] for r in ranks) for i in range(args.repeats)]
        return statistics.median(per_run)

    fp32 = slowest_median("fp32")
    onebit = slowest_median("onebit")
    return {
        "size_mb": args.size_mb,
        "numel": ranks[0]["numel"],
        "num_processes": ranks[0]["num_processes"],
        "rate": args.rate if shaped else None,
        "repeats": args.repeats,
        "median_s": {"fp32_pmean": fp32, "onebit_pmean": onebit},
        "barrier_median_s": slowest_median("barrier"),
        "speedup": fp32 / onebit,
        "wire_bytes_per_device": {
            "fp32_pmean": ranks[0]["wire"]["fp32"],
            "onebit_pmean": ranks[0]["wire"]["onebit"],
        },
        "times_s": {r["rank"]: r["times"] for r in ranks},
    }


def _table(s: dict) -> str:
    link = s["rate"] or "unshaped loopback"
    w = s["wire_bytes_per_device"]
    rows = [
        f"{s['num_processes']} processes x {s['size_mb']:g} MiB fp32, link: {link}, "
        f"median of {s['repeats']} (barrier {s['barrier_median_s'] * 1e3:.1f} ms)",
        f"{'method':<22}{'median (s)':>12}{'wire / device':>16}",
        f"{'fp32 lax.pmean':<22}{s['median_s']['fp32_pmean']:>12.4f}"
        f"{w['fp32_pmean'] / 2**20:>12.2f} MiB",
        f"{'1-bit compressed_pmean':<22}{s['median_s']['onebit_pmean']:>12.4f}"
        f"{w['onebit_pmean'] / 2**20:>12.2f} MiB",
        f"speedup {s['speedup']:.2f}x (target >= {TARGET_RATIO:g}x), "
        f"wire ratio {w['fp32_pmean'] / max(w['onebit_pmean'], 1):.1f}x",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0

    from jaxcomm.launch import LaunchError, launch_local, network_shaping_problem

    shaped = not args.no_shape
    if shaped:
        problem = network_shaping_problem(args.rate)
        if problem:
            print(f"SKIP: cannot shape the network ({problem}); rerun with --no-shape", flush=True)
            return 0
    with tempfile.TemporaryDirectory(prefix="jaxcomm-bench-") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", out]
        cmd += ["--size-mb", str(args.size_mb), "--repeats", str(args.repeats)]
        result = launch_local(
            2,
            cmd,
            env={"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"},
            timeout=args.timeout,
            netns_rate=args.rate if shaped else None,
            echo=True,
        )
        if not result.ok:
            raise LaunchError(result)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    summary = _summarize(ranks, args, shaped)
    print(_table(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
