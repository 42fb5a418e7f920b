"""Train-step time of sharded data parallel (ZeRO 1-2) with int8 traffic vs plain fp32 DP, 1 Gbit/s.

Two processes (one CPU device each, gloo collectives over TCP), each in its own network
namespace, joined by a full-duplex link shaped with ``tc tbf`` to ``--rate`` each way
(``duplex.sh`` via the shared driver ``benchmarks/_two_ranks.py``; ``--topo lo``: one shaped
loopback for both directions, the earlier setup). Each trains the
same MLP (``--width`` x ``--width`` layers, ``--layers`` of them: 16.8M fp32 parameters, 64 MiB, by
default) with Adam through ``jc.make_train_step``, one method after the other:

* ``fp32``: plain data parallel, ``optax.chain(jc.compressed_mean(axis, jc.NoCompression()),
  optax.adam(lr))`` (one fused fp32 all-reduce of the gradients, full Adam state per device);
* ``sharded``: ``jc.sharded(optax.adam(lr), axis)``, exact fp32 reduce-scatter and all-gather;
* ``sharded_int8``: ``jc.sharded(..., compressor=jc.Quantize(bits=8),
  gather_compressor=jc.Quantize(bits=8))``: int8 gradients (qgZ) and int8 weights (qwZ);
* ``sharded_int4``: int4 gradients (ZeRO++'s qgZ default) and int8 weights.

Timing: 2 warm-up steps per method, then ``--repeats`` rounds that time one step of every
method in turn, each preceded by a barrier (a tiny cross-process psum) so that both ranks start
together; a step's time is the slower rank's; the table shows medians and the speedup against
``fp32`` of the same run. Bytes on the wire per device per step come from the compiled HLO
(:func:`jaxcomm.inspect.wire_bytes`); optimizer-state bytes per device from the arrays.

Usage (root, for duplex.sh's namespaces and ``tc``; ``--no-shape`` runs on the unshaped
loopback)::

    python benchmarks/sharded_1gbit.py [--width 2048] [--layers 4] [--rate 1gbit] [--topo auto|lo]
                                       [--repeats 5]
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
METHODS = {
    "fp32": "plain DP: fp32 all-reduce + Adam",
    "sharded": "jc.sharded(adam), exact scatter/gather",
    "sharded_int8": "jc.sharded(adam), int8 grads + int8 weights",
    "sharded_int4": "jc.sharded(adam), int4 grads + int8 weights",
}


def make_tx(name: str, axis: str, lr: float = 1e-3):
    import optax

    import jaxcomm as jc

    adam = optax.adam(lr)
    if name == "fp32":
        return optax.chain(jc.compressed_mean(axis, jc.NoCompression()), adam)
    if name == "sharded":
        return jc.sharded(adam, axis)
    if name == "sharded_int8":
        return jc.sharded(
            adam, axis, compressor=jc.Quantize(bits=8), gather_compressor=jc.Quantize(bits=8)
        )
    if name == "sharded_int4":
        return jc.sharded(
            adam, axis, compressor=jc.Quantize(bits=4), gather_compressor=jc.Quantize(bits=8)
        )
    raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from _two_ranks import two_rank_parser

    p = two_rank_parser(__doc__, methods=METHODS, repeats_help="timed steps per method")
    p.add_argument("--width", type=int, default=2048, help="hidden width (2048)")
    p.add_argument("--layers", type=int, default=4, help="width x width layers (4)")
    p.add_argument("--batch", type=int, default=16, help="examples per process per step (16)")
    return p.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    from _two_ranks import barrier as make_barrier
    from _two_ranks import finish_worker, mlp, start_gloo

    rank, n, mesh = start_gloo()  # before JAX is imported: one CPU device per process
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.inspect import wire_bytes

    split = NamedSharding(mesh, P("dp"))
    params, loss_fn, local = mlp(args.width, args.layers, args.batch, rank)
    numel = sum(x.size for x in jax.tree.leaves(params))
    batch = tuple(jax.make_array_from_process_local_data(split, a) for a in local)
    barrier = make_barrier(mesh)

    names = [m for m in args.methods.split(",") if m]
    steps, states, wire, state_bytes, losses = {}, {}, {}, {}, {}
    for name in names:
        step, state = jc.make_train_step(mesh, "dp", loss_fn, make_tx(name, "dp"), params)
        compiled = step.lower(state, batch).compile()
        wire[name] = wire_bytes(compiled.as_text())
        state_bytes[name] = sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state)
        )
        steps[name], states[name], losses[name] = compiled, state, []

    def run(name):
        states[name], loss = steps[name](states[name], batch)
        jax.block_until_ready((states[name], loss))
        losses[name].append(float(loss))

    times: dict[str, list[float]] = {name: [] for name in names}
    times["barrier"] = []
    for name in names:
        for _ in range(WARMUP):
            barrier()
            run(name)
    for _ in range(args.repeats):  # rounds: a burst of load hits every method alike
        for name in names:
            times["barrier"].append(barrier())
            t0 = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t0)
    for name in names:
        print(f"rank {rank} {name}: {[round(t, 4) for t in times[name]]}", flush=True)
    result = dict(
        rank=rank,
        num_processes=n,
        numel=numel,
        times=times,
        wire=wire,
        state_bytes=state_bytes,
        losses=losses,
    )
    finish_worker(args, rank, result, barrier)


def _summarize(ranks: list[dict], args: argparse.Namespace, shaped: bool) -> dict:
    def slowest_median(name: str) -> float:
        per_run = [max(r["times"][name][i] for r in ranks) for i in range(args.repeats)]
        return statistics.median(per_run)

    names = [k for k in ranks[0]["times"] if k != "barrier"]
    medians = {name: slowest_median(name) for name in names}
    base = medians.get("fp32")
    wire = ranks[0]["wire"]
    return {
        "numel": ranks[0]["numel"],
        "num_processes": ranks[0]["num_processes"],
        "rate": args.rate if shaped else None,
        "repeats": args.repeats,
        "median_s": medians,
        "barrier_median_s": slowest_median("barrier"),
        "speedup_vs_fp32": {k: base / medians[k] for k in names} if base else {},
        "wire_bytes_per_device": wire,
        "opt_state_bytes_per_device": ranks[0]["state_bytes"],
        "losses_rank0": ranks[0]["losses"],
        "times_s": {r["rank"]: r["times"] for r in ranks},
    }


def _table(s: dict) -> str:
    link = s["rate"] or "unshaped loopback"
    rows = [
        f"{s['num_processes']} processes, MLP of {s['numel'] / 1e6:.1f}M fp32 params, Adam, "
        f"link: {link}, median step of {s['repeats']} "
        f"(barrier {s['barrier_median_s'] * 1e3:.1f} ms)",
        f"{'method':<46}{'step (s)':>10}{'wire/device':>14}{'opt state/dev':>15}{'speedup':>9}",
    ]
    for name, median in s["median_s"].items():
        speed = s["speedup_vs_fp32"].get(name)
        rows.append(
            f"{METHODS[name]:<46}{median:>10.4f}"
            f"{s['wire_bytes_per_device'][name] / 2**20:>10.2f} MiB"
            f"{s['opt_state_bytes_per_device'][name] / 2**20:>11.1f} MiB"
            + (f"{speed:>8.2f}x" if speed else "")
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0

    from _two_ranks import report_two_ranks

    return report_two_ranks(
        __file__, argv, args, prefix="jaxcomm-sharded-", summarize=_summarize, table=_table
    )


if __name__ == "__main__":
    sys.exit(main())
