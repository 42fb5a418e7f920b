"""``jaxcomm bench`` on a 1 Gbit/s link: all-reduce across compressors and message sizes.

Two processes (one CPU device each, gloo over TCP) in a private network namespace whose
loopback is shaped to ``--rate`` with ``tc tbf`` (root), the stand-in for an Ethernet cluster.
Every compressor the bench's registry can build without arguments runs (``none``, ``onebit``,
and whatever ``jaxcomm`` exports, e.g. ``quantize``, ``cast``), plus ``quantize(bits=4)``, on
a sweep of sizes; columns as in ``jaxcomm bench`` (median time, algbw = S/t, busbw, bytes on the
wire per device from the compiled HLO, wire bw, error of one call). The speedup column is each
row's time against the ``none`` row of the same size.

Usage (root; ``--no-shape`` runs on the plain loopback)::

    python benchmarks/sweep_1gbit.py [--sizes 256K,4M,64M] [--rate 1gbit] [--repeats 5]
                                     [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="256K,4M,64M", help="message sizes (256K,4M,64M)")
    p.add_argument("--rate", default="1gbit", help="tc rate of the shaped loopback (1gbit)")
    p.add_argument("--compressors", default=None, help="specs (every registered one + int4)")
    p.add_argument("--ops", default="all_reduce", help="ops (all_reduce)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row (5)")
    p.add_argument("--no-shape", action="store_true", help="run on the plain loopback")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--plot", metavar="PNG", help="algbw against size, one line per compressor")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    from jaxcomm.cli import bench, bench_report, bench_specs
    from jaxcomm.cli.netshape import network_shaping_problem

    rate = None if args.no_shape else args.rate
    if rate and network_shaping_problem(rate):
        print(f"SKIP: cannot shape the network ({network_shaping_problem(rate)}); "
              "rerun with --no-shape", flush=True)  # fmt: skip
        return 0
    if args.compressors:
        compressors = bench_specs.split_specs(args.compressors)
    else:
        compressors = bench_specs.registered_compressors()
        if "quantize" in compressors:
            compressors.append("quantize(bits=4)")
    config = bench_specs.BenchConfig(
        ops=tuple(bench_specs.split_specs(args.ops)),
        compressors=tuple(compressors),
        sizes=tuple(bench_specs.parse_size(s) for s in bench_specs.split_specs(args.sizes)),
        repeats=args.repeats,
    ).validate()
    rows = bench.run_bench(config, procs=2, rate=rate, timeout=args.timeout, echo=False)
    by_key = {(r.op, r.size_bytes, r.compressor): r for r in rows}
    link = rate or "plain loopback"
    bench_report.print_rows(rows, f"2 processes, link {link}, median of {args.repeats}")
    print(f"\nmedian time and speedup vs none, link {link}")
    print(f"{'op':<16}{'size':>8}  " + "".join(f"{c:>20}" for c in config.compressors))
    for op in config.ops:
        for size in sorted({r.size_bytes for r in rows}):
            base = by_key.get((op, size, "none"))
            cells = []
            for comp in config.compressors:
                r = by_key.get((op, size, comp))
                if r is None:
                    cells.append("-")
                    continue
                speed = f" {base.median_s / r.median_s:5.1f}x" if base else ""
                cells.append(f"{r.median_s * 1e3:.1f} ms{speed}")
            size_text = bench_report.human_bytes(size)
            print(f"{op:<16}{size_text:>8}  " + "".join(f"{c:>20}" for c in cells))
    if args.json:
        Path(args.json).write_text(
            json.dumps(bench_report.rows_to_json(rows, config, rate=rate), indent=2)
        )
    if args.plot:
        bench_report.plot_rows(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
