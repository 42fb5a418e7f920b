"""DiLoCo's outer sync in the background vs in the step, on a shaped link: time per cycle.

Two processes (one CPU device each, gloo), each in its own network namespace, joined by a
full-duplex link shaped with ``tc tbf`` to ``--rate`` each way (``duplex.sh``, through the shared
driver ``benchmarks/_two_ranks.py``; ``--topo lo``: one shaped loopback, one queue for both
directions, the half-duplex setup of the earlier results), the 64 MiB MLP of ``user_path.py``
(4 x 2048 x 2048, 16.8M fp32 parameters, 16 examples per process), ``jc.make_train_step`` with
``jc.diloco(optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True), H, fragments=F,
overlap_steps=tau, compressor=...)`` and ``mean_metrics=False`` (each process's own loss: the
inner steps send nothing; ``--mean-metrics`` adds the per-step loss all-reduce). Rows, each a
full cycle of ``H`` steps (every fragment's sync issued and merged inside it):

* ``floor``: ``H`` inner steps and no sync (``sync_every`` past the run): the target;
* ``blocking``: ``background=False``, the reduction inside the step program of ``t_s + 1``
  (the single-program ``overlap_steps=tau``; the default path);
* ``background``: ``background=True``, the same algorithm with the reduction on a host thread.

``tau`` defaults to ``H // F - 1``, the largest the schedule allows. Each row first runs
``--warmup`` untimed cycles: on XLA:CPU the first few syncs grow the host heap to its peak, each
new page a fault (about 20 us a fault on the 2-core VM of the committed results: 0.5-1.6 s
spikes in the first five cycles, rare after), which a long run pays once. ``--pin`` puts rank
``r`` on core ``r``. Rounds alternate the rows; the table gives each row's median cycle over
``--repeats`` rounds, slower rank, and the ratios to the floor. The JSON (``--json``) records
the command, versions, machine and date, and ``background_wire``: the bytes each process sent
per cycle in the background sync and the link time they need at least: on the full-duplex link
each process's bytes go their own way at the rate, so it is the larger process's bytes over the
rate; with ``--topo lo`` both processes' bytes pass one token bucket, so it is their sum over the
rate (twice as long for this symmetric traffic: the earlier results' ``200mbit`` stood in for 100
Mbit/s each way). A background cycle cannot be shorter than its link time. The JSON also records
the link (``"link"``: duplex.sh's topology, the rate, full duplex or not).

Usage (root, for duplex.sh's namespaces and ``tc``)::

    python benchmarks/diloco_background.py [--rate 100mbit] [--topo auto|lo] [--H 16] [--F 1] \\
        [--bits 4] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("floor", "blocking", "background")
LR = 1e-3
WIDTH, LAYERS, BATCH = 2048, 4, 16


def _parse(argv=None) -> argparse.Namespace:
    from _two_ranks import two_rank_parser

    p = two_rank_parser(
        __doc__.split("\n")[0],
        methods=METHODS,
        rate="100mbit",
        repeats=3,
        repeats_help="timed cycles per row",
        timeout=1200.0,
    )
    p.add_argument("--H", type=int, default=16, help="sync_every (16)")
    p.add_argument("--F", type=int, default=1, help="fragments (1)")
    p.add_argument("--tau", type=int, default=None, help="overlap_steps (H // F - 1)")
    p.add_argument(
        "--bits", default="4", help="outer gradient: 1 (jc.OneBit), 4, 8 (jc.Quantize + EF), exact"
    )
    p.add_argument(
        "--mean-metrics",
        action="store_true",
        help="average the loss over processes every step (one all-reduce per inner step)",
    )
    p.add_argument(
        "--model",
        default="mlp",
        choices=("mlp", "transformer"),
        help="the 64 MiB MLP (16 examples a process) or the 16.8M-parameter transformer of "
        "train_step_1gbit.py (--transformer-batch sequences of 64 tokens a process)",
    )
    p.add_argument("--transformer-batch", type=int, default=4)
    p.add_argument(
        "--warmup",
        type=int,
        default=6,
        help="untimed cycles per row first (6, at least 2): on XLA:CPU the first syncs grow the "
        "host heap (page faults); a long run pays that once",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin rank r to CPU core r (one core each: the processes do not compete for cores, "
        "and XLA's pool has one thread)",
    )
    p.add_argument("--trace", action="store_true", help="also time each step and sync stage")
    return p.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    if args.pin:  # before JAX starts: XLA sizes its thread pool from the affinity
        os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})
    import jax
    import numpy as np
    import optax
    from _two_ranks import finish_worker, mlp, start_as_user
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    rank, n, mesh = start_as_user()
    H, F = args.H, args.F
    tau = args.tau if args.tau is not None else H // F - 1
    if args.model == "transformer":
        from train_step_1gbit import make_transformer

        params, loss_fn, batch = make_transformer(
            argparse.Namespace(batch=args.transformer_batch), rank
        )
    else:
        params, loss_fn, batch = mlp(WIDTH, LAYERS, BATCH, rank, linear_last=True)
    if args.bits == "exact":
        compressor = None
    elif args.bits == "1":
        compressor = jc.OneBit()
    else:
        compressor = jc.Quantize(int(args.bits), error_feedback=True)

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
    for name in names:
        # Until the host heap has grown to its peak: XLA:CPU's first syncs allocate fresh pages.
        for _ in range(args.warmup - 2):
            jax.block_until_ready(runs[name](H))
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}  # this process's CPU seconds (all threads) per cycle
    threads: dict = {name: [] for name in names}  # the same by thread
    core = int(os.environ["RANK"]) % os.cpu_count() if args.pin else None
    cores: dict = {name: [] for name in names}  # the pinned core's time by kind, per cycle
    links = runs["background"].background._links if "background" in runs else None
    sent = links.sent_bytes if links else 0
    for _ in range(args.repeats):
        for name in names:
            barrier(token).block_until_ready()
            sync_thread = _sync_thread(runs.get("background"))
            k0 = _core_times(core)
            t0, c0, th0 = time.perf_counter(), time.process_time(), _thread_cpu(sync_thread)
            jax.block_until_ready(runs[name](H))
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            th1, k1 = _thread_cpu(sync_thread), _core_times(core)
            threads[name].append({k: th1[k] - th0[k] for k in th0})
            if k0 and k1:
                cores[name].append({k: k1[k] - k0[k] for k in k0})
    sent = (links.sent_bytes - sent) / args.repeats if links else None
    trace = None
    if args.trace and "background" in runs:
        trace = _trace(runs["background"], H)
        if "floor" in runs:
            trace["floor_steps"] = _steps(runs["floor"], H, time.perf_counter())
    result = {
        "rank": rank,
        "times": times,
        "cpu": cpu,
        "thread_cpu": threads,
        **({"core": cores} if core is not None else {}),
        "compile_s": compile_s,
        "tau": tau,
        "sent_bytes_per_cycle": sent,
        "trace": trace,
    }
    finish_worker(args, rank, result)


def _thread_cpu(sync_thread: int | None) -> dict[str, float]:
    """This process's CPU seconds so far by thread: the main thread, the background sync's
    thread, XLA's intra-op pool and the rest (the runtime's execution threads, gloo)."""
    import threading

    main = threading.main_thread().native_id
    out = {"main": 0.0, "sync": 0.0, "xla_pool": 0.0, "other": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        group = (
            "main"
            if int(tid) == main
            else "sync"
            if int(tid) == sync_thread
            else "xla_pool"
            if "Eigen" in name
            else "other"
        )
        out[group] += ns / 1e9
    return out


def _core_times(core: int | None) -> dict[str, float] | None:
    """The seconds core ``core`` has spent so far (``/proc/stat``, 10 ms ticks) running
    processes (``user``: user + nice + system), in interrupts (``irq``: irq + softirq; the
    emulated link's packets are handled there, charged to no process), idle (idle + iowait)
    and taken by the hypervisor (``steal``: on a VM, time the core did not run at all);
    ``None`` unpinned or where unreadable."""
    if core is None:
        return None
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith(f"cpu{core} "):
                ticks = [int(v) for v in line.split()[1:9]]
                break
        else:
            return None
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (t / hz for t in ticks)
    return {
        "user": user + nice + system,
        "irq": irq + softirq,
        "idle": idle + iowait,
        "steal": steal,
    }


def _sync_thread(run) -> int | None:
    """The native id of the background sync's thread, once it has started."""
    thread = getattr(getattr(run, "background", None), "_runner", None)
    thread = getattr(thread, "_thread", None)
    return None if thread is None else thread.native_id


def _steps(run, H: int, t0: float) -> list:
    """``H`` steps, each waited for: ``(start, seconds)`` from ``t0``."""
    import jax

    steps = []
    for _ in range(H):
        start = time.perf_counter()
        jax.block_until_ready(run(1))
        steps.append((start - t0, time.perf_counter() - start))
    return steps


def _trace(run, H: int) -> dict:
    """One more background cycle, each step waited for, with the host thread's stages timed
    (diagnostics: which step waits, how long each exchange takes). Each stage is
    ``(name, start, wall seconds, the calling thread's CPU seconds)``; device programs are
    waited for where they are called (their CPU is on XLA's threads, not the caller's).
    ``cpu_s``: the process's CPU seconds (all threads) over the cycle."""
    import jax

    from jaxcomm.optim.diloco import background as bg
    from jaxcomm.runtime import host_links as ex

    stages, t0 = [], time.perf_counter()

    def timed(name, fn, block=False):
        def wrapper(*args, **kw):
            start, cpu = time.perf_counter(), time.thread_time()
            out = fn(*args, **kw)
            if block:
                out = jax.block_until_ready(out)
            stages.append((name, start - t0, time.perf_counter() - start, time.thread_time() - cpu))
            return out

        return wrapper

    sync = run.background
    for programs in sync._programs.values():
        for name in ("issue", "worker", "server", "finish"):
            setattr(programs, name, timed(name, getattr(programs, name), block=True))
    # Instance attributes shadow the methods; module attributes are restored below.
    sync._exchange_once = timed("thread_total", sync._exchange_once)
    sync._links.swap = timed("socket", sync._links.swap)
    patched = {
        (bg, "all_to_all"): "all_to_all",
        (bg, "all_gather"): "all_gather",
        (ex, "_pack"): "pack",
        (ex, "_unpack"): "unpack",
    }
    for name in ("_rows", "_host_rows"):
        if hasattr(sync, name):
            setattr(sync, name, timed("device_get", getattr(sync, name)))
    originals = {key: getattr(*key) for key in patched if hasattr(*key)}
    for (module, attr), name in patched.items():
        if (module, attr) in originals:
            setattr(module, attr, timed(name, originals[module, attr]))
    try:
        cpu = time.process_time()
        steps = _steps(run, H, t0)
        cpu = time.process_time() - cpu
    finally:
        for (module, attr), fn in originals.items():
            setattr(module, attr, fn)
    return {"steps": steps, "stages": stages, "cpu_s": cpu}


def _bytes_per_second(rate: str) -> float:
    """``tc`` rate (``100mbit``, ``1gbit``, ``500kbit``) in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"unknown rate {rate!r}: write e.g. 100mbit or 1gbit")


def _wire(ranks: list[dict], args, shaped: bool, cycle: dict) -> dict | None:
    """The background sync's bytes per cycle and the link time they need at least: on the
    full-duplex link each direction has its own token bucket (the larger process's bytes over
    the rate); on the shared loopback (``--topo lo``) both processes' bytes pass one (their sum
    over the rate)."""
    sent = [r.get("sent_bytes_per_cycle") for r in ranks]
    if None in sent:
        return None
    wire = {"sent_bytes_per_cycle": sent}
    if shaped:
        one_queue = args.topo == "lo"
        link_s = (sum(sent) if one_queue else max(sent)) / _bytes_per_second(args.rate)
        wire["link_queues"] = "one, both directions" if one_queue else "one per direction"
        wire["link_s_per_cycle"] = link_s
        if "floor" in cycle:
            wire["link_over_floor"] = link_s / cycle["floor"]
    return wire


def _cpu(ranks: list[dict]) -> dict:
    """Each row's median CPU seconds per cycle (all threads of the process), per rank."""
    import statistics

    return {k: [statistics.median(r["cpu"][k]) for r in ranks] for k in ranks[0]["cpu"]}


def _medians_by_kind(ranks: list[dict], field: str) -> dict:
    """Each row's median seconds per cycle by kind, per rank, of the per-cycle dicts in
    ``field``: ``"thread_cpu"`` (CPU by thread group) or ``"core"`` (the pinned core's time by
    kind, :func:`_core_times`); a row with no record on some rank is left out."""
    import statistics

    return {
        k: [
            {g: statistics.median(c[g] for c in r[field][k]) for g in r[field][k][0]} for r in ranks
        ]
        for k in ranks[0][field]
        if all(r[field][k] for r in ranks)
    }


def _summarize(ranks: list[dict], args, shaped: bool) -> dict:
    from _two_ranks import provenance, slower_rank_medians
    from train_step_1gbit import TRANSFORMER

    cycle = slower_rank_medians(ranks)
    ratios = {f"{k}_over_floor": v / cycle["floor"] for k, v in cycle.items() if "floor" in cycle}
    wire = _wire(ranks, args, shaped, cycle)
    return {
        **provenance(),
        "rate": args.rate if shaped else "unshaped",
        "model": (
            f"transformer {TRANSFORMER} (16.8M fp32 parameters), {args.transformer_batch} "
            "sequences per process"
            if args.model == "transformer"
            else f"MLP {LAYERS} x {WIDTH} x {WIDTH} (64 MiB fp32), batch {BATCH} per process"
        ),
        "H": args.H,
        "fragments": args.F,
        "overlap_steps": ranks[0]["tau"],
        "mean_metrics": args.mean_metrics,
        "pinned": args.pin,
        "warmup_cycles": args.warmup,
        "outer_gradient": {"exact": "exact fp32", "1": "1-bit (jc.OneBit)"}.get(
            args.bits, f"int{args.bits} + EF"
        ),
        "repeats": args.repeats,
        "cycle_s": cycle,
        # Every round's cycle by rank and row (the medians above hide how much a row moves).
        "rounds_s": [{k: [round(t, 4) for t in v] for k, v in r["times"].items()} for r in ranks],
        "compile_s": {k: max(r["compile_s"][k] for r in ranks) for k in cycle},
        **({"cpu_s_per_cycle": _cpu(ranks)} if "cpu" in ranks[0] else {}),
        **(
            {"thread_cpu_s_per_cycle": _medians_by_kind(ranks, "thread_cpu")}
            if "thread_cpu" in ranks[0]
            else {}
        ),
        **({"core_s_per_cycle": _medians_by_kind(ranks, "core")} if ranks[0].get("core") else {}),
        "ratios": ratios,
        **({"background_wire": wire} if wire else {}),
        **({"trace": [r["trace"] for r in ranks]} if ranks[0].get("trace") else {}),
    }


def _table(summary: dict) -> str:
    lines = [
        f"DiLoCo cycle, 2 processes{' (pinned)' if summary.get('pinned') else ''}, "
        f"{summary['rate']}, H={summary['H']}, "
        f"F={summary['fragments']}, tau={summary['overlap_steps']}, "
        f"{summary['outer_gradient']}, median of {summary['repeats']}, slower rank",
        f"{'row':<12} {'cycle s':>9} {'x floor':>8} {'CPU s/rank':>11}",
    ]
    cpu = summary.get("cpu_s_per_cycle", {})
    for name, s in summary["cycle_s"].items():
        ratio = summary["ratios"].get(f"{name}_over_floor", float("nan"))
        per_rank = cpu.get(name)
        cpu_s = sum(per_rank) / len(per_rank) if per_rank else float("nan")
        lines.append(f"{name:<12} {s:9.3f} {ratio:8.3f} {cpu_s:11.3f}")
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

    return report_two_ranks(
        __file__, argv, args, prefix="diloco_bg_", summarize=_summarize, table=_table
    )


if __name__ == "__main__":
    sys.exit(main())
