"""Latency-bound case: a 300-leaf tree of small leaves between 2 processes over a 1 ms link.

When every leaf is small, a collective costs its link latency, not its bytes, so what matters is
how many collective rounds a step makes. jaxcomm coalesces the whole tree into one bucket (one
1-bit chain: 4 collectives); reducing leaf by leaf (as a per-tensor hook does) makes 300 chains.

Two processes (one CPU device each, gloo over TCP) reduce the same tree with four methods:

* ``per-leaf fp32``: ``lax.pmean`` on every leaf (XLA's combiner may merge some of them);
* ``coalesced fp32``: ``jc.compressed_pmean(..., jc.NoCompression())``: one exact collective;
* ``per-leaf 1-bit``: ``jc.compressed_pmean`` called on each leaf with ``jc.OneBit()``;
* ``coalesced 1-bit``: ``jc.compressed_pmean`` on the whole tree with ``jc.OneBit()``.

The link: first the plain loopback, then a one-way delay of ``--delay`` (1 ms) on every
connection between the ranks: ``tc netem`` on the loopback of a private network namespace where
the kernel has it (root), else the userspace TCP relay of :mod:`jaxcomm.cli._delay` (the
ranks' gloo connections go through a relay that forwards each byte 1 ms later, both ways; the
``jax.distributed`` coordinator is not delayed). The output says which one was used and the
median time of one tiny psum on that link.

Timing: 2 warm-up calls, then ``--repeats`` timed calls, each after a barrier; a call's time is
the slower rank's; medians. The collectives per call are counted in the compiled HLO. The
target: coalesced 1-bit >= 20x faster than per-leaf 1-bit at 1 ms.

Usage::

    python benchmarks/latency_bound.py [--leaves 300] [--delay 1ms] [--repeats 5] [--json OUT]
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
TARGET = 20.0
METHODS = ("per-leaf fp32", "coalesced fp32", "per-leaf 1-bit", "coalesced 1-bit")
LEAF_SIZES = (8, 32, 64, 128, 256, 768)  # biases, norms, small kernels


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--leaves", type=int, default=300, help="leaves in the tree (300)")
    p.add_argument("--delay", default="1ms", help="one-way link delay (1ms)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method (5)")
    p.add_argument("--skip-plain", action="store_true", help="only the delayed link")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def local_tree(rank: int, leaves: int):
    import numpy as np

    rng = np.random.default_rng([rank, leaves])
    return {
        f"leaf{i:03d}": rng.standard_normal(LEAF_SIZES[i % len(LEAF_SIZES)], dtype=np.float32)
        for i in range(leaves)
    }


def _worker(args) -> None:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    import jax
    import numpy as np
    from _two_ranks import finish_worker
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.inspect import collectives_in_hlo

    info = jc.init_distributed("gloo", initialization_timeout=120)
    rank, n = info.process_id, info.num_processes
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    sharded = NamedSharding(mesh, P("dp"))

    def to_global(tree):
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharded, np.asarray(x)), tree
        )

    local = local_tree(rank, args.leaves)
    x = to_global(local)
    onebit, exact = jc.OneBit(), jc.NoCompression()
    tree_state = to_global(jc.init_state(onebit, local, axis_size=n))
    leaf_states = to_global({k: jc.init_state(onebit, v, axis_size=n) for k, v in local.items()})

    def smap(fn, n_in):
        specs = (P("dp"),) * n_in
        out = (P(), P("dp")) if n_in == 2 else P()
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out))

    def per_leaf_onebit(t, s):
        pairs = {k: jc.compressed_pmean(t[k], s[k], axis_name="dp", compressor=onebit) for k in t}
        return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}

    fns = {
        "per-leaf fp32": (smap(lambda t: jax.tree.map(lambda v: lax.pmean(v, "dp"), t), 1), ()),
        "coalesced fp32": (
            smap(lambda t: jc.compressed_pmean(t, None, axis_name="dp", compressor=exact)[0], 1),
            (),
        ),
        "per-leaf 1-bit": (smap(per_leaf_onebit, 2), (leaf_states,)),
        "coalesced 1-bit": (
            smap(lambda t, s: jc.compressed_pmean(t, s, axis_name="dp", compressor=onebit), 2),
            (tree_state,),
        ),
    }
    token = to_global(np.ones((1,), np.float32))
    sync = smap(lambda t: lax.psum(t, "dp"), 1)

    def barrier() -> float:
        t0 = time.perf_counter()
        sync(token).block_until_ready()
        return time.perf_counter() - t0

    collectives, compile_s, times = {}, {}, {m: [] for m in (*METHODS, "tiny psum")}
    barrier()
    for _ in range(20):  # the link's latency as one collective sees it, back to back
        times["tiny psum"].append(barrier())
    for name, (fn, extra) in fns.items():
        t0 = time.perf_counter()
        compiled = fn.lower(x, *extra).compile()
        compile_s[name] = time.perf_counter() - t0
        collectives[name] = len(collectives_in_hlo(compiled.as_text()))
        for i in range(WARMUP + args.repeats):
            barrier()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, *extra))
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
        print(f"{name}: {collectives[name]} collectives, {[round(t, 4) for t in times[name]]}")
    result = dict(rank=rank, times=times, collectives=collectives, compile_s=compile_s)
    finish_worker(args, rank, result, barrier)


def _run(args, delay: str | None) -> dict:
    from jaxcomm.cli.launch import LaunchError, launch_local
    from jaxcomm.cli.netshape import delay_options

    shaping, label = delay_options(delay)
    with tempfile.TemporaryDirectory(prefix="jaxcomm-latency-") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", out]
        cmd += ["--leaves", str(args.leaves), "--repeats", str(args.repeats)]
        result = launch_local(
            2,
            cmd,
            env={"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
            timeout=args.timeout,
            echo=True,
            **shaping,
        )
        if not result.ok:
            raise LaunchError(result)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]

    def slowest_median(name: str) -> float:
        runs = zip(*(r["times"][name] for r in ranks), strict=True)
        return statistics.median(max(run) for run in runs)

    med = {m: slowest_median(m) for m in METHODS}
    return {
        "link": label,
        "median_s": med,
        "tiny_psum_median_s": slowest_median("tiny psum"),
        "collectives": ranks[0]["collectives"],
        "compile_s": ranks[0]["compile_s"],
        "speedup_onebit": med["per-leaf 1-bit"] / med["coalesced 1-bit"],
        "speedup_fp32": med["per-leaf fp32"] / med["coalesced fp32"],
    }


def _table(s: dict, leaves: int, repeats: int) -> str:
    lines = [
        f"{leaves} leaves, 2 processes, link: {s['link']}; median of {repeats} "
        f"(one tiny psum: {s['tiny_psum_median_s'] * 1e3:.2f} ms)",
        f"{'method':<18}{'collectives':>12}{'median (ms)':>14}",
    ]
    for m in METHODS:
        lines.append(f"{m:<18}{s['collectives'][m]:>12}{s['median_s'][m] * 1e3:>14.2f}")
    lines.append(
        f"coalesced vs per-leaf: 1-bit {s['speedup_onebit']:.1f}x, fp32 {s['speedup_fp32']:.1f}x"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    runs = [] if args.skip_plain else [_run(args, None)]
    delayed = _run(args, args.delay)
    runs.append(delayed)
    print()
    for s in runs:
        print(_table(s, args.leaves, args.repeats))
        print()
    ok = delayed["speedup_onebit"] >= TARGET
    print(
        f"{'PASS' if ok else 'FAIL'}: coalesced 1-bit is {delayed['speedup_onebit']:.1f}x faster "
        f"than per-leaf 1-bit at {args.delay} (target >= {TARGET:g}x)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"leaves": args.leaves, "repeats": args.repeats, "runs": runs}, indent=2)
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
