"""DiLoCo's outer sync in the background vs in the step, on a shaped link: time per cycle.

Two processes (one CPU device each, gloo) on a loopback shaped with ``tc tbf`` (the shared
driver ``benchmarks/_two_ranks.py``), the 64 MiB MLP of ``user_path.py`` (4 x 2048 x 2048,
16.8M fp32 parameters, 16 examples per process), ``jc.make_train_step`` with
``jc.diloco(optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True), H, fragments=F,
overlap_steps=tau, compressor=...)`` and ``mean_metrics=False`` (each process's own loss: the
inner steps send nothing; ``--mean-metrics`` adds the per-step loss all-reduce). Rows, each a
full cycle of ``H`` steps (every fragment's sync issued and merged inside it):

* ``floor``: ``H`` inner steps and no sync (``sync_every`` past the run): the target;
* ``blocking``: ``background=False``, the reduction inside the step program of ``t_s + 1``
  (the single-program ``overlap_steps=tau``; the default path);
* ``background``: ``background=True``, the same algorithm with the reduction on a host thread.

``tau`` defaults to ``H // F - 1``, the largest the schedule allows. Rounds alternate the rows;
the table gives each row's median cycle over ``--repeats`` rounds, slower rank, and the ratios
to the floor. The JSON (``--json``) records the command, versions, machine and date, and
``background_wire``: the bytes each process sent per cycle in the background sync and the
link time they need at least. The shaped loopback passes both processes' bytes through one
token bucket, so that time is both processes' bytes over the rate: twice what a full-duplex
link of the same rate needs for this symmetric traffic (``--rate 200mbit`` stands in for
100 Mbit/s each way). A background cycle cannot be shorter than its link time.

Usage (root for ``unshare``/``tc``)::

    python benchmarks/diloco_background.py [--rate 100mbit] [--H 16] [--F 1] [--bits 4] \\
        [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("floor", "blocking", "background")
LR = 1e-3
WIDTH, LAYERS, BATCH = 2048, 4, 16


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="100mbit", help="tc rate of the shaped loopback (100mbit)")
    p.add_argument("--H", type=int, default=16, help="sync_every (16)")
    p.add_argument("--F", type=int, default=1, help="fragments (1)")
    p.add_argument("--tau", type=int, default=None, help="overlap_steps (H // F - 1)")
    p.add_argument("--bits", default="4", help="outer gradient: 4, 8 (jc.Quantize + EF), exact")
    p.add_argument("--repeats", type=int, default=3, help="timed cycles per row (3)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument("--no-shape", action="store_true", help="run on the unshaped loopback")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before giving up")
    p.add_argument(
        "--mean-metrics",
        action="store_true",
        help="average the loss over processes every step (one all-reduce per inner step)",
    )
    p.add_argument("--trace", action="store_true", help="also time each step and sync stage")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    jax.distributed.initialize(
        coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        num_processes=int(os.environ["WORLD_SIZE"]),
        process_id=int(os.environ["RANK"]),
    )
    rank, n = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((n,), ("dp",))
    H, F = args.H, args.F
    tau = args.tau if args.tau is not None else H // F - 1
    init = np.random.default_rng(0)
    params = {
        f"l{i}": {
            "w": jnp.asarray(init.standard_normal((WIDTH, WIDTH), np.float32) / np.sqrt(WIDTH)),
            "b": jnp.zeros(WIDTH),
        }
        for i in range(LAYERS)
    }

    def loss_fn(p, batch):
        x, y = batch
        for i in range(LAYERS):
            x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            x = jnp.tanh(x) if i < LAYERS - 1 else x
        return jnp.mean((x - y) ** 2)

    data = np.random.default_rng(1 + rank)
    batch = (
        data.standard_normal((BATCH, WIDTH), np.float32),
        data.standard_normal((BATCH, WIDTH), np.float32),
    )
    compressor = None if args.bits == "exact" else jc.Quantize(int(args.bits), error_feedback=True)

    def train(sync_every, background):
        tx = jc.diloco(
            optax.adam(LR),
            optax.sgd(0.7, momentum=0.9, nesterov=True),
            sync_every,
            "dp",
            compressor=compressor,
            fragments=F,
            overlap_steps=tau,
            background=background,
        )
        step, state = jc.make_train_step(
            mesh, "dp", loss_fn, tx, params, mean_metrics=args.mean_metrics
        )
        holder = {"state": state}

        def run(steps):
            for _ in range(steps):
                holder["state"], loss = step(holder["state"], batch)
            return loss

        run.background = step.background
        return run

    builders = {
        "floor": lambda: train(10**6, False),
        "blocking": lambda: train(H, False),
        "background": lambda: train(H, True),
    }
    names = [m for m in args.methods.split(",") if m]
    token = jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), np.ones(1))
    barrier = jax.jit(
        jax.shard_map(lambda t: lax.psum(t, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    )
    runs, compile_s = {}, {}
    for name in names:
        t0 = time.perf_counter()
        runs[name] = builders[name]()
        jax.block_until_ready(runs[name](2 * H))  # every phase compiled, at a cycle boundary
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in names}
    links = runs["background"].background._links if "background" in runs else None
    sent = links.sent_bytes if links else 0
    for _ in range(args.repeats):
        for name in names:
            barrier(token).block_until_ready()
            t0 = time.perf_counter()
            jax.block_until_ready(runs[name](H))
            times[name].append(time.perf_counter() - t0)
    sent = (links.sent_bytes - sent) / args.repeats if links else None
    trace = _trace(runs["background"], H) if args.trace and "background" in runs else None
    Path(args.worker, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "times": times,
                "compile_s": compile_s,
                "tau": tau,
                "sent_bytes_per_cycle": sent,
                "trace": trace,
            }
        )
    )
    jax.distributed.shutdown()


def _trace(run, H: int) -> dict:
    """One more background cycle, each step waited for, with the host thread's stages timed
    (diagnostics: which step waits, how long each exchange takes)."""
    import jax

    from jaxcomm.optim import diloco_background as bg

    stages, t0 = [], time.perf_counter()

    def timed(name, fn):
        def wrapper(*args, **kw):
            start = time.perf_counter()
            out = fn(*args, **kw)
            stages.append((name, start - t0, time.perf_counter() - start))
            return out

        return wrapper

    def timed_program(name, fn):
        def wrapper(*args):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            stages.append((name, start - t0, time.perf_counter() - start))
            return out

        return wrapper

    for programs in run.background._programs.values():
        for name in ("worker", "server", "finish"):
            setattr(programs, name, timed_program(name, getattr(programs, name)))
    originals = bg.all_to_all, bg.all_gather
    bg.all_to_all, bg.all_gather = (
        timed("all_to_all", originals[0]),
        timed("all_gather", originals[1]),
    )
    steps = []
    try:
        for _ in range(H):
            start = time.perf_counter()
            jax.block_until_ready(run(1))
            steps.append((start - t0, time.perf_counter() - start))
    finally:
        bg.all_to_all, bg.all_gather = originals
    return {"steps": steps, "stages": stages}


def _bytes_per_second(rate: str) -> float:
    """``tc`` rate (``100mbit``, ``1gbit``, ``500kbit``) in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"unknown rate {rate!r}: write e.g. 100mbit or 1gbit")


def _wire(ranks: list[dict], args, shaped: bool, cycle: dict) -> dict | None:
    """The background sync's bytes per cycle and the link time they need at least: the shaped
    loopback passes both processes' bytes (both directions) through one token bucket."""
    sent = [r.get("sent_bytes_per_cycle") for r in ranks]
    if None in sent:
        return None
    wire = {"sent_bytes_per_cycle": sent}
    if shaped:
        link_s = sum(sent) / _bytes_per_second(args.rate)
        wire["link_s_per_cycle"] = link_s
        if "floor" in cycle:
            wire["link_over_floor"] = link_s / cycle["floor"]
    return wire


def _summarize(ranks: list[dict], args, shaped: bool) -> dict:
    from _two_ranks import provenance, slower_rank_medians

    cycle = slower_rank_medians(ranks)
    ratios = {f"{k}_over_floor": v / cycle["floor"] for k, v in cycle.items() if "floor" in cycle}
    wire = _wire(ranks, args, shaped, cycle)
    return {
        **provenance(),
        "rate": args.rate if shaped else "unshaped",
        "model": f"MLP {LAYERS} x {WIDTH} x {WIDTH} (64 MiB fp32), batch {BATCH} per process",
        "H": args.H,
        "fragments": args.F,
        "overlap_steps": ranks[0]["tau"],
        "mean_metrics": args.mean_metrics,
        "outer_gradient": "exact fp32" if args.bits == "exact" else f"int{args.bits} + EF",
        "repeats": args.repeats,
        "cycle_s": cycle,
        "compile_s": {k: max(r["compile_s"][k] for r in ranks) for k in cycle},
        "ratios": ratios,
        **({"background_wire": wire} if wire else {}),
        **({"trace": [r["trace"] for r in ranks]} if ranks[0].get("trace") else {}),
    }


def _table(summary: dict) -> str:
    lines = [
        f"DiLoCo cycle, 2 processes, {summary['rate']}, H={summary['H']}, "
        f"F={summary['fragments']}, tau={summary['overlap_steps']}, "
        f"{summary['outer_gradient']}, median of {summary['repeats']}, slower rank",
        f"{'row':<12} {'cycle s':>9} {'x floor':>8}",
    ]
    for name, s in summary["cycle_s"].items():
        ratio = summary["ratios"].get(f"{name}_over_floor", float("nan"))
        lines.append(f"{name:<12} {s:9.3f} {ratio:8.3f}")
    wire = summary.get("background_wire") or {}
    if "link_s_per_cycle" in wire:
        lines.append(
            f"background sync: {max(wire['sent_bytes_per_cycle']) / 1e6:.2f} MB sent per process "
            f"a cycle, {wire['link_s_per_cycle']:.3f} s of the shaped link at least "
            f"({wire.get('link_over_floor', float('nan')):.2f}x floor)"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    from _two_ranks import report_two_ranks

    worker_args = [
        f"--H={args.H}",
        f"--F={args.F}",
        f"--bits={args.bits}",
        f"--repeats={args.repeats}",
        f"--methods={args.methods}",
        *(["--trace"] if args.trace else []),
        *(["--mean-metrics"] if args.mean_metrics else []),
    ]
    if args.tau is not None:
        worker_args.append(f"--tau={args.tau}")
    return report_two_ranks(
        __file__, worker_args, args, prefix="diloco_bg_", summarize=_summarize, table=_table
    )


if __name__ == "__main__":
    sys.exit(main())
