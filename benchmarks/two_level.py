"""Two emulated hosts of 4 devices each: 1-bit Adam over ``("host", "local")`` against the rest.

Two processes, each with 4 CPU devices (``JAX_NUM_CPU_DEVICES=4``), each in its own network
namespace, joined by a full-duplex link shaped to ``--rate`` each way (``duplex.sh RATE 2``, the
repository's ``../shared/tools/duplex.sh``; ``--topo lo`` gives its single shaped loopback, one
queue for both directions, for A/B runs). Each process calls
``jax.distributed.initialize(COORD, NPROC, RANK)`` as a user's script does and trains the 64 MiB
MLP of ``benchmarks/_two_ranks.py`` (``--layers`` x ``--width`` x ``--width`` + bias, tanh,
16.8M fp32 parameters by default; ``--batch`` rows per process, split over its 4 devices).
Rows, each the whole step (``jc.make_train_step`` with its defaults unless said):

* ``local`` (a): every device its own ``optax.adam`` step on its own rows, nothing sent (a jitted
  ``shard_map`` over the 8 devices without a collective): the floor;
* ``exact_tuple`` (b): ``optax.chain(jc.compressed_mean(("host", "local"), jc.NoCompression()),
  optax.adam(lr))`` on ``jax.make_mesh((2, 4), ("host", "local"))``;
* ``onebit_flat`` (c): ``jc.onebit_adam(lr, freeze_step=2, axis_name="dp")`` on
  ``jax.make_mesh((8,), ("dp",))``, the same 8 devices as one flat axis;
* ``onebit_tuple`` (d): ``jc.onebit_adam(lr, freeze_step=2, axis_name=("host", "local"))`` on the
  two-level mesh: exact inside a host, 1-bit across hosts.

The 1-bit rows are timed after their warm-up (compressed steps). ``--warmup`` untimed steps per
row, then ``--repeats`` rounds that time one step of every row in turn (a burst of load hits all
rows alike), each step after a barrier (a tiny psum over the 8 devices); a step's time is the
slower process's; the table gives the medians, the ratios the targets are about (d vs c >= 1.25x,
d vs b >= 2x, d / a <= 1.5x) and the bytes each device sends per step, from the compiled program:
in all collectives, and in those whose groups span both hosts (``jc.wire_bytes_by_axes`` on the
``("host", "local")`` view of the 8 devices; a flat collective counts whole, though part of it
stays inside a host), against the reference ``2 x P x 1 bit / 8 / 4`` (d's target: <= 1.3x, plus
a few kB of scalars). A row that cannot be built (e.g. an axis the installed jaxcomm refuses) is
skipped with its reason. ``--json OUT`` writes the summary with the command, versions, machine
and date.

Read the times with this emulation's limit in mind: once a CPU client spans several processes,
XLA:CPU runs every collective through gloo (TCP), also those among one process's own devices, so
the ``local`` level here is much slower than NVLink or ICI: on the 2-core machine this was
written on (busy), a reduce-scatter of 16.8 MB fp32 per device over one process's 4 devices took
about 0.5 s with two processes and 15-40 ms in a single process. Rows (b) and (d) pay for that;
(c) sends its few bytes in one flat exchange.

Usage (root, for the network namespaces)::

    python benchmarks/two_level.py [--rate 1gbit] [--topo auto|lo] [--repeats 7] [--warmup 4]
        [--rows local,exact_tuple,onebit_flat,onebit_tuple] [--width 2048] [--layers 4]
        [--batch 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

ROWS = {
    "local": "(a) local Adam per device, nothing sent",
    "exact_tuple": "(b) exact Adam over (host, local)",
    "onebit_flat": "(c) onebit_adam over flat dp (8)",
    "onebit_tuple": "(d) onebit_adam over (host, local)",
}
TUPLE = ("host", "local")
LR = 1e-3
FREEZE = 2
NPROC = 2
LOCAL_DEVICES = 4


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--rate", default="1gbit", help="tc rate of each direction (1gbit), or none")
    p.add_argument(
        "--topo",
        default="auto",
        choices=("auto", "veth", "bridge", "lo"),
        help="duplex.sh's DUPLEX_TOPO: auto (a veth pair, full duplex) or lo (one shared queue)",
    )
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (7)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per row (4, > freeze)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated ({','.join(ROWS)})")
    p.add_argument("--width", type=int, default=2048, help="MLP width (2048)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers (4)")
    p.add_argument("--batch", type=int, default=16, help="rows per process (16)")
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before both are killed")
    p.add_argument("--duplex", default=None, help="path of duplex.sh (../shared/tools/duplex.sh)")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.row_list = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.row_list if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.warmup <= FREEZE:
        p.error(f"--warmup must exceed the 1-bit warm-up ({FREEZE} steps)")
    if args.batch % LOCAL_DEVICES:
        p.error(f"--batch must be a multiple of {LOCAL_DEVICES} (split over the devices)")
    return args


# --------------------------------------------------------------------------------------------
# Worker (one process per emulated host).
# --------------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    import jax

    jax.distributed.initialize(
        os.environ["COORD"], int(os.environ["NPROC"]), int(os.environ["RANK"])
    )
    import numpy as np
    import optax
    from _two_ranks import mlp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.inspect.hlo import wire_bytes

    rank, nproc, nlocal = jax.process_index(), jax.process_count(), jax.local_device_count()
    mesh = jax.make_mesh((nproc, nlocal), TUPLE)
    flat = jax.make_mesh((nproc * nlocal,), ("dp",))
    # JAX's default device order puts each process's devices on one "host" row, and the flat
    # axis in the same order: checked, the rows below rely on it.
    for m in (mesh.devices, flat.devices.reshape(nproc, nlocal)):
        if [sorted({d.process_index for d in row}) for row in m] != [[r] for r in range(nproc)]:
            raise SystemExit(f"rank {rank}: a host row of the default mesh spans processes: {m}")
    flat_view = Mesh(flat.devices.reshape(nproc, nlocal), TUPLE)

    params, loss_fn, local_batch = mlp(args.width, args.layers, args.batch, rank)
    numel = sum(int(np.size(x)) for x in jax.tree.leaves(params))

    def place(m, spec):
        return jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(NamedSharding(m, spec), a),
            local_batch,
        )

    token = jax.make_array_from_process_local_data(
        NamedSharding(flat, P("dp")), np.ones((nlocal,), np.float32)
    )
    psum = jax.jit(
        jax.shard_map(lambda t: lax.psum(t, "dp"), mesh=flat, in_specs=P("dp"), out_specs=P())
    )

    def barrier() -> None:
        psum(token).block_until_ready()

    def build_local():
        adam = optax.adam(LR)

        def body(state, batch):
            p, opt = jax.tree.map(lambda x: x[0], state)
            loss, grads = jax.value_and_grad(loss_fn)(p, batch)
            updates, opt = adam.update(grads, opt, p)
            return jax.tree.map(lambda x: x[None], (optax.apply_updates(p, updates), opt)), loss[
                None
            ]

        def init(p):
            p = jax.tree.map(lambda x: x[0], p)
            return jax.tree.map(lambda x: x[None], (p, adam.init(p)))

        def sm(f, outs):
            return jax.shard_map(f, mesh=flat, in_specs=P("dp"), out_specs=outs, check_vma=False)

        stacked = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                NamedSharding(flat, P("dp")), np.broadcast_to(x, (nlocal, *np.shape(x)))
            ),
            params,
        )
        state = jax.jit(sm(init, P("dp")))(stacked)
        step = jax.jit(
            jax.shard_map(
                body,
                mesh=flat,
                in_specs=(P("dp"), P("dp")),
                out_specs=(P("dp"), P("dp")),
                check_vma=False,
            ),
            donate_argnums=(0,),
        )
        batch = place(flat, P("dp"))
        return step, state, batch, flat

    def build_train_step(m, axis, tx):
        step, state = jc.make_train_step(m, axis, loss_fn, tx, params)
        return step, state, place(m, P(axis)), m

    def build(name):
        if name == "local":
            return build_local()
        if name == "exact_tuple":
            tx = optax.chain(jc.compressed_mean(TUPLE, jc.NoCompression()), optax.adam(LR))
            return build_train_step(mesh, TUPLE, tx)
        if name == "onebit_flat":
            return build_train_step(
                flat, "dp", jc.onebit_adam(LR, freeze_step=FREEZE, axis_name="dp")
            )
        tx = jc.onebit_adam(LR, freeze_step=FREEZE, axis_name=TUPLE)
        return build_train_step(mesh, TUPLE, tx)

    runners: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    losses: dict[str, list[float]] = {}
    compile_s: dict[str, float] = {}
    for name in args.row_list:
        t0 = time.perf_counter()
        try:
            step, state, batch, m = build(name)
            holder = {"state": state}
            losses[name] = []
            for _ in range(args.warmup):
                barrier()
                holder["state"], loss = step(holder["state"], batch)
                jax.block_until_ready((holder["state"], loss))
                losses[name].append(float(np.mean(np.asarray(loss.addressable_data(0)))))
        except Exception as e:  # the same on both processes: the row is skipped on both
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"rank {rank}: SKIP {name}: {skipped[name]}", flush=True)
            losses.pop(name, None)
            continue
        compile_s[name] = time.perf_counter() - t0
        runners[name] = dict(step=step, holder=holder, batch=batch, mesh=m)

    wire: dict[str, dict] = {}
    for name, r in runners.items():
        text = r["step"].lower(r["holder"]["state"], r["batch"]).compile().as_text()
        view = flat_view if r["mesh"] is flat else mesh
        by_axes = jc.wire_bytes_by_axes(text, view)
        wire[name] = dict(
            total=wire_bytes(text),
            cross_host=sum(v for k, v in by_axes.items() if "host" in k),
            by_axes={",".join(k) or "-": v for k, v in by_axes.items()},
        )

    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, r in runners.items():
            holder = r["holder"]
            barrier()
            t0 = time.perf_counter()
            holder["state"], loss = r["step"](holder["state"], r["batch"])
            jax.block_until_ready((holder["state"], loss))
            times[name].append(time.perf_counter() - t0)
            losses[name].append(float(np.mean(np.asarray(loss.addressable_data(0)))))
    for name in runners:
        print(f"rank {rank} {name}: {[round(t * 1e3, 1) for t in times[name]]} ms", flush=True)

    result = dict(
        rank=rank,
        num_processes=nproc,
        local_devices=nlocal,
        numel=numel,
        times=times,
        wire=wire,
        skipped=skipped,
        losses=losses,
        compile_s=compile_s,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(result))
    barrier()  # both written before either leaves
    jax.distributed.shutdown()


# --------------------------------------------------------------------------------------------
# Launcher.
# --------------------------------------------------------------------------------------------


def _duplex(args) -> Path | str:
    """duplex.sh's path, or why it cannot run here (the shared driver's checks)."""
    from _two_ranks import duplex_path, duplex_problem

    path = duplex_path(args.duplex)
    return duplex_problem(path) or path


def summarize(ranks: list[dict], args, duplex: Path) -> dict:
    from _two_ranks import provenance, slower_rank_medians

    medians = slower_rank_medians(ranks) if ranks[0]["times"] else {}
    wire = ranks[0]["wire"]
    numel = ranks[0]["numel"]
    n_fast = ranks[0]["local_devices"]
    ratios = {}
    m = medians

    def ratio(key, num, den, target, better):
        if num in m and den in m and m[den] > 0:
            value = m[num] / m[den]
            ratios[key] = dict(value=value, target=target, met=better(value, target))

    ratio("d_speedup_vs_c", "onebit_flat", "onebit_tuple", 1.25, lambda v, t: v >= t)
    ratio("d_speedup_vs_b", "exact_tuple", "onebit_tuple", 2.0, lambda v, t: v >= t)
    ratio("d_over_a", "onebit_tuple", "local", 1.5, lambda v, t: v <= t)
    reference = 2 * numel * 1 / 8 / n_fast
    if "onebit_tuple" in wire:
        value = wire["onebit_tuple"]["cross_host"] / reference
        # + a few kB of scalars (the loss, the skip guard) on top of the 1.3x
        met = wire["onebit_tuple"]["cross_host"] <= 1.3 * reference + 8192
        ratios["d_cross_host_over_reference"] = dict(value=value, target=1.3, met=met)
    return dict(
        provenance=provenance(
            duplex=os.path.relpath(duplex, REPO),
            rate=args.rate,
            topo=args.topo,
            numpy=_np_version(),
        ),
        setup=dict(
            processes=NPROC,
            devices_per_process=n_fast,
            params=numel,
            width=args.width,
            layers=args.layers,
            batch_per_process=args.batch,
            warmup=args.warmup,
            repeats=args.repeats,
            lr=LR,
            freeze_step=FREEZE,
        ),
        median_s=medians,
        ratios=ratios,
        wire_bytes_per_device=wire,
        # Only the compressed share should cross: 2 x P x bits / 8 / n_fast (1 bit).
        cross_host_reference_bytes=reference,
        skipped=ranks[0]["skipped"],
        peak_rss_mib={f"rank{r['rank']}": r["peak_rss_mib"] for r in ranks},
        losses={k: [v[0], v[-1]] for k, v in ranks[0]["losses"].items() if v},
        times={f"rank{r['rank']}": r["times"] for r in ranks},
    )


def _np_version() -> str:
    import numpy as np

    return np.__version__


def table(s: dict) -> str:
    lines = [
        f"2 processes x {s['setup']['devices_per_process']} devices, "
        f"{s['setup']['params'] / 1e6:.1f}M parameters, rate {s['provenance']['rate']} "
        f"(topo {s['provenance']['topo']}), medians of {s['setup']['repeats']} rounds, "
        "slower process",
        f"{'row':<42} {'step ms':>9} {'MB/dev':>9} {'x-host MB/dev':>14}",
    ]
    for name, desc in ROWS.items():
        if name in s["skipped"]:
            lines.append(f"{desc:<42} skipped: {s['skipped'][name]}")
            continue
        if name not in s["median_s"]:
            continue
        w = s["wire_bytes_per_device"][name]
        lines.append(
            f"{desc:<42} {s['median_s'][name] * 1e3:>9.1f} {w['total'] / 1e6:>9.3f} "
            f"{w['cross_host'] / 1e6:>14.3f}"
        )
    names = {
        "d_speedup_vs_c": "d vs c (flat 1-bit / two-level 1-bit)",
        "d_speedup_vs_b": "d vs b (exact / two-level 1-bit)",
        "d_over_a": "d / a (two-level 1-bit / local)",
        "d_cross_host_over_reference": "d cross-host bytes / reference",
    }
    for key, r in s["ratios"].items():
        sign = ">=" if key.startswith("d_speedup") else "<="
        lines.append(
            f"{names[key]:<42} {r['value']:>6.2f}x  target {sign} {r['target']}x: "
            f"{'met' if r['met'] else 'NOT met'}"
        )
    rss = ", ".join(f"{k} {v:.0f} MiB" for k, v in s["peak_rss_mib"].items())
    lines.append(f"peak resident memory: {rss}")
    ref = s["cross_host_reference_bytes"]
    lines.append(f"cross-host reference 2 x P x 1 bit / 8 / n_fast = {ref / 1e6:.3f} MB/device")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    duplex = _duplex(args)
    if isinstance(duplex, str):
        print(f"SKIP: cannot emulate two hosts: {duplex}", flush=True)
        return 0
    env = dict(os.environ)
    env.update(
        JAX_NUM_CPU_DEVICES=str(LOCAL_DEVICES),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        DUPLEX_TIMEOUT=str(args.timeout),
        XLA_FLAGS=" ".join(
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ),
    )
    if args.topo != "auto":
        env["DUPLEX_TOPO"] = args.topo
    argv = sys.argv[1:] if argv is None else list(argv)
    with tempfile.TemporaryDirectory(prefix="two_level_") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", out, *argv]
        proc = subprocess.run(
            ["bash", str(duplex), args.rate, str(NPROC), "--", *cmd],
            env=env,
            cwd=str(REPO),
            timeout=args.timeout + 60,
            check=False,
        )
        if proc.returncode != 0:
            print(f"FAILED: duplex.sh exited with {proc.returncode}", flush=True)
            return proc.returncode
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(NPROC)]
    summary = summarize(ranks, args, duplex)
    print(table(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
