"""A PREDICTION of step times (not a measurement), from compiled programs and published chip
figures, for data-parallel training over DCN links of 25, 50 and 100 Gbit/s per host; and the
same cost model checked against the step times measured on CPU over a shaped 1 Gbit/s link.

The cost model, per step and device (every input read from a compiled program, except the
chip's figures):

* ``compute = max(flops / peak_flops, bytes_accessed / hbm_bandwidth)`` (roofline), with
  ``flops`` and ``bytes accessed`` from ``compiled.cost_analysis()``. XLA:GPU compiled without
  a GPU gives no cost analysis: the H100 rows use the flops and bytes of the same method's
  TPU v5e program (the same step's math);
* ``comm = k * dcn_bytes / link + ici_bytes / ici_bandwidth + collectives * alpha``:
  ``dcn_bytes`` are the bytes per device of the collectives that cross hosts (ring/pairwise
  model, ``jaxcomm.inspect``), ``k`` the devices that share a host's link. A single-slice
  topology is taken as data parallelism over hosts (every collective byte crosses DCN:
  an upper bound for ring collectives, right for all-to-all); on a multislice or multi-host
  topology only the bytes whose replica groups span nodes cross DCN, the rest use ICI/NVLink;
* ``step = compute + (1 - f) * comm + max(0, f * comm - compute)`` with ``f`` the share of
  collective bytes the compiled schedule overlaps with compute (``aot_report.py``).

``alpha`` (fixed cost per collective) is unknown for DCN and taken as 0 there; on the CPU check
it is 3 ms, the fixed cost of one collective measured on the shaped 1 Gbit/s loopback (see
``jaxcomm.OneBit``'s notes), and the check is shown with and without it.

Published figures (per chip): TPU v5e 197 TFLOP/s bf16, 819 GB/s HBM, 1,600 Gbit/s ICI
(https://cloud.google.com/tpu/docs/v5e); TPU v5p 459 TFLOP/s bf16, 2,765 GB/s HBM,
4,800 Gbit/s ICI (https://cloud.google.com/tpu/docs/v5p); H100 SXM 989 TFLOP/s dense bf16,
3.35 TB/s HBM3, 900 GB/s NVLink (https://www.nvidia.com/en-us/data-center/h100/). Devices per
host: 4 (v5e, v5p), 8 (H100). The CPU check uses this machine's measured matmul rate and copy
bandwidth (halved: the two ranks share its cores) in place of published figures (there are none
for a shared vCPU), and the programs
of ``benchmarks/user_path.py`` compiled for 2 CPU devices; its measured times are read from
``benchmarks/results/user_path_1gbit.json``.

Usage::

    python benchmarks/step_prediction.py --aot DIR[,DIR...] [--json OUT]   # prediction
    python benchmarks/step_prediction.py --cpu-check [--json OUT]          # model vs CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CHIPS = {
    "tpu v5 lite": dict(name="TPU v5e", flops=197e12, hbm=819e9, ici=1600e9 / 8, per_host=4),
    "tpu v5": dict(name="TPU v5p", flops=459e12, hbm=2765e9, ici=4800e9 / 8, per_host=4),
    "nvidia h100 80gb hbm3": dict(name="H100", flops=989e12, hbm=3.35e12, ici=900e9, per_host=8),
}
DCN_GBITS = (25, 50, 100)


def chip_of(device_kind: str) -> dict:
    key = device_kind.lower()
    for k in sorted(CHIPS, key=len, reverse=True):  # "tpu v5 lite" before "tpu v5"
        if key.startswith(k):
            return CHIPS[k]
    raise KeyError(f"no published figures for {device_kind!r}")


def step_time(compute, dcn_bytes, ici_bytes, collectives, overlap, *, link, ici, k, alpha=0.0):
    """The model's step time (seconds) and its comm term."""
    comm = k * dcn_bytes / link + ici_bytes / ici + collectives * alpha
    return compute + (1 - overlap) * comm + max(0.0, overlap * comm - compute), comm


def comm_split(row: dict) -> tuple[float, float]:
    """(DCN, ICI) bytes per device of a report row (see the module docstring)."""
    a = row["analysis"]
    if row.get("slices", 1) > 1:
        dcn = a.get("cross_slice_bytes") or 0.0
        return dcn, max(a["wire_bytes"] - dcn, 0.0)
    return a["wire_bytes"], 0.0


def predict(dirs: list[str]) -> list[dict]:
    rows = []
    for d in dirs:
        with open(os.path.join(d, "aot_report.json")) as f:
            rows += [r for r in json.load(f)["rows"] if r.get("compiles")]
    # The H100 rows borrow the v5e program's cost (no cost analysis without a GPU).
    v5e_cost: dict = {}
    for r in sorted(rows, key=lambda r: r.get("slices", 1), reverse=True):  # single slice wins
        if r.get("cost") and r["topology"].startswith("v5e"):
            v5e_cost[(r["method"], r["phase"], r["flags"])] = r["cost"]
    out = []
    for r in rows:
        chip = chip_of(r["device_kind"])
        cost, borrowed = r.get("cost"), False
        if not cost:
            cost, borrowed = v5e_cost.get((r["method"], r["phase"], r["flags"])), True
        if not cost:
            continue
        compute = max(cost["flops"] / chip["flops"], cost["bytes accessed"] / chip["hbm"])
        dcn, ici_b = comm_split(r)
        a = r["analysis"]
        f = a["overlap_fraction"] or 0.0
        pred = {}
        for g in DCN_GBITS:
            pred[g], _ = step_time(compute, dcn, ici_b, 0, f, link=g * 1e9 / 8, ici=chip["ici"],
                                   k=chip["per_host"])  # fmt: skip
        out.append(dict(
            method=r["method"], phase=r["phase"], topology=r["topology"], flags=r["flags"],
            chip=chip["name"], compute_s=compute, cost_from_v5e=borrowed, dcn_bytes=dcn,
            ici_bytes=ici_b, overlap=f, predicted_s=pred,
        ))  # fmt: skip
    return out


def print_prediction(rows: list[dict]) -> None:
    print("PREDICTED step time per device (ms), not measured; see the module docstring")
    head = f"{'method':<14}{'phase':<11}{'topology':<12}{'flags':<8}{'compute':>9}{'DCN B':>10}"
    head += f"{'ICI B':>10}{'ovl':>5}" + "".join(f"{str(g) + ' Gb/s':>11}" for g in DCN_GBITS)
    print(head)
    for r in rows:
        print(
            f"{r['method']:<14}{r['phase']:<11}{r['topology']:<12}{r['flags']:<8}"
            f"{r['compute_s'] * 1e3:>8.3f}{'*' if r['cost_from_v5e'] else ' '}"
            f"{r['dcn_bytes']:>10.0f}{r['ici_bytes']:>10.0f}{r['overlap']:>5.0%}"
            + "".join(f"{r['predicted_s'][g] * 1e3:>11.3f}" for g in DCN_GBITS)
        )
    print("* compute from the v5e program's cost analysis (XLA:GPU gives none without a GPU)")


# ---------------------------------------------------------------------------------------------
# The CPU check: user_path.py's programs on 2 CPU devices, against its measured times.

USER_PATH_ALPHA = 3e-3  # fixed cost of one collective on the shaped loopback (gloo)


def _median(fn, *args, repeats=5):
    import statistics

    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cpu_peaks() -> dict:
    """This machine's fp32 matmul rate and copy bandwidth, on one CPU device (timed)."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((2048, 2048), jnp.float32), dev)
    mm = _median(jax.jit(lambda x: x @ x), a)
    # In place (donated), as a train step updates its state: a fresh 64 MiB output per call
    # would time the page faults of its allocation, not the memory bandwidth.
    nbytes = 4 * (16 << 20)
    add = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    x = add(jax.device_put(jnp.ones((16 << 20,), jnp.float32), dev))
    times = []
    for _ in range(7):
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        x = jax.block_until_ready(add(x))
        times.append(time.perf_counter() - t0)
    return dict(flops=2 * 2048**3 / mm, hbm=2 * nbytes / sorted(times)[3])


def cpu_programs() -> dict:
    """name -> compiled program of user_path.py's rows, for 2 CPU devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from user_path import BATCH, LAYERS, LR, WIDTH

    import jaxcomm as jc

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",))
    split = NamedSharding(mesh, P("dp"))
    params = {f"l{i}": {"w": jnp.zeros((WIDTH, WIDTH)), "b": jnp.zeros(WIDTH)}
              for i in range(LAYERS)}  # fmt: skip

    def loss_fn(p, batch):
        x, y = batch
        for i in range(LAYERS):
            x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            x = jnp.tanh(x) if i < LAYERS - 1 else x
        return jnp.mean((x - y) ** 2)

    batch = (np.zeros((2 * BATCH, WIDTH), np.float32),) * 2
    placed = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=split), batch)
    out = {}
    for name, tx, warm in (
        ("exact_adam", optax.chain(jc.compressed_mean("dp", jc.NoCompression()),
                                   optax.adam(LR)), 1),
        ("onebit_adam", jc.onebit_adam(LR, freeze_step=4, axis_name="dp"), 6),
    ):  # fmt: skip
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
        for _ in range(warm):
            state, loss = step(state, batch)
        jax.block_until_ready(loss)
        out[name] = step.program(step.phases(state, batch)).lower(state, placed).compile()
    comp = jc.OneBit()
    like = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    st = jax.eval_shape(lambda: jc.stack_per_device(jc.init_state(comp, like, axis_size=2), 2))
    st = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=split), st)
    grads = {"w": jax.ShapeDtypeStruct((2 * 4096, 4096), jnp.float32, sharding=split)}
    for name, reduce in (
        ("readme_pmean", lambda g, s: (lax.pmean(g, "dp"), s)),
        ("readme_onebit", lambda g, s: jc.compressed_pmean(g, s, axis_name="dp", compressor=comp)),
    ):
        fn = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=(P("dp"), P("dp")),
                                   out_specs=(P(), P("dp"))))  # fmt: skip
        out[name] = fn.lower(grads, st).compile()
    opt = optax.adam(LR)

    def local_step(state, b):
        p, s = state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = opt.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    one = jax.tree.map(lambda b: b[:BATCH], batch)
    out["local"] = jax.jit(local_step).lower((params, opt.init(params)), one).compile()
    return out


def cpu_check(peaks: dict | None = None) -> dict:
    import jax
    from aot_report import analyse, cost_of

    measured = json.loads((HERE / "results" / "user_path_1gbit.json").read_text())
    peaks = peaks or cpu_peaks()
    ranks = 2  # the two ranks share this machine's cores and memory: each gets half the peaks
    link = 1e9 / 8
    rows = []
    for name, compiled in cpu_programs().items():
        cost = cost_of(compiled)
        a = analyse(compiled.as_text(), jax.devices()[:2])
        compute = ranks * max(cost["flops"] / peaks["flops"], cost["bytes accessed"] / peaks["hbm"])
        n_coll = len(a["collectives"])
        # k = 2: both ranks' traffic goes through the one shaped loopback queue.
        kw = dict(link=link, ici=1.0, k=2)
        plain, comm = step_time(compute, a["wire_bytes"], 0.0, 0, 0.0, **kw)
        with_alpha, _ = step_time(compute, a["wire_bytes"], 0.0, n_coll, 0.0,
                                  alpha=USER_PATH_ALPHA, **kw)  # fmt: skip
        m = measured["step_s"][name]
        rows.append(dict(method=name, flops=cost["flops"], bytes_accessed=cost["bytes accessed"],
                         compute_s=compute, wire_bytes=a["wire_bytes"], collectives=n_coll,
                         predicted_s=plain, predicted_alpha_s=with_alpha, measured_s=m,
                         error=plain / m - 1, error_alpha=with_alpha / m - 1))  # fmt: skip
    return dict(peaks=peaks, alpha_s=USER_PATH_ALPHA, rows=rows)


def print_cpu_check(res: dict) -> None:
    p = res["peaks"]
    print(f"CPU check: measured peaks {p['flops'] / 1e9:.1f} GFLOP/s, {p['hbm'] / 1e9:.1f} GB/s"
          f" copy; 1 Gbit/s shared by 2 ranks; alpha {res['alpha_s'] * 1e3:.0f} ms")  # fmt: skip
    print(f"{'method':<15}{'compute ms':>11}{'wire B':>12}{'coll':>5}{'pred ms':>9}"
          f"{'err':>7}{'pred+a ms':>10}{'err':>7}{'measured ms':>12}")  # fmt: skip
    for r in res["rows"]:
        print(f"{r['method']:<15}{r['compute_s'] * 1e3:>11.2f}{r['wire_bytes']:>12.0f}"
              f"{r['collectives']:>5}{r['predicted_s'] * 1e3:>9.1f}{r['error']:>7.0%}"
              f"{r['predicted_alpha_s'] * 1e3:>10.1f}{r['error_alpha']:>7.0%}"
              f"{r['measured_s'] * 1e3:>12.1f}")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aot", help="comma-separated aot_report.py --out folders")
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--peaks", metavar="JSON", help="CPU peaks from --measure-peaks (else timed)")
    p.add_argument("--measure-peaks", metavar="OUT", help="time the CPU peaks only, write them")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    result: dict = {"command": " ".join([sys.executable, *sys.argv]),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    if args.aot:
        result["prediction"] = predict(args.aot.split(","))
        print_prediction(result["prediction"])
    if args.measure_peaks:
        peaks = cpu_peaks()
        Path(args.measure_peaks).write_text(json.dumps(peaks))
        print(peaks)
    if args.cpu_check:
        peaks = json.loads(Path(args.peaks).read_text()) if args.peaks else None
        result["cpu_check"] = cpu_check(peaks)
        print_cpu_check(result["cpu_check"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    if "--cpu-check" in sys.argv or "--measure-peaks" in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    raise SystemExit(main())
