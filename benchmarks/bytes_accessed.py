"""Bytes accessed per train step, by XLA's own cost analysis, against a local ``optax.adam`` step.

A memory-bound step takes time in proportion to the bytes it reads and writes, so this is the
compiled program's cost on an accelerator at its memory-bandwidth limit, measured without one.
For every optimizer of ``step_models.methods`` (the README's calls with default arguments and
short schedules), ``jc.make_train_step(mesh, "dp", loss_fn, tx, params)`` is compiled for
every phase of its schedule (``step.program(phases).lower(state, batch)``; the phase values
are read by running the same optimizer for a few steps on a tiny model, since the schedule
and not the model decides them), and ``compiled.cost_analysis()["bytes accessed"]`` (per
device) is set against the same figure for a plain ``jax.jit`` of loss, gradient and
``optax.adam`` (donated) on one device's batch. Compile only: nothing runs at full size, the
state is abstract (``jax.eval_shape``).

Each row also has a target: the ratio to the local step the issue asks each program to stay
within (1.15x for the exact mean, also 1-bit Adam's warm-up, which is exact Adam; 1.5x for
the compressed optimizers, every 0/1 Adam phase and DiLoCo's sync step; 1.05x for DiLoCo's
inner step; 2x for DeMo).

CPU by default (``JAX_NUM_CPU_DEVICES`` simulated devices; XLA:CPU's fusion decisions, so a
GPU's figures differ: ``benchmarks/gpu_check.py`` records the same cost analysis on a GPU);
each row also has ``hlo_bytes``/``hlo_ratio``, the same programs counted from their HLO text
by ``benchmarks/hlo_bytes.py``, beside the cost analysis. ``--platform h100`` compiles every
program for 8 H100s on one host (``h100:1x1x8``, no GPU needed, with jax[cuda12]) and the
local step for one H100, and since XLA:GPU gives no cost analysis without a GPU, both sides
of the ratio are the HLO count. Every optimizer keeps its default arguments there too: on GPU
``make_train_step`` checks the skip cap on the host, so no host callback is compiled::

    python benchmarks/bytes_accessed.py [--model mlp|gpt] [--devices 2,8] [--json OUT]
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv/cuda/bin/python benchmarks/bytes_accessed.py \
        --platform h100 --json benchmarks/results/bytes_accessed_h100.json

``--unguarded-residuals`` compiles the staged codecs with their new residuals written
unconditionally instead of kept on a skipped step (and the verdict after the exchange): not a
usable step (a NaN would poison the error feedback), only the measure of what the exact skip
costs.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hlo_bytes import breakdown, hlo_bytes_accessed, hlo_bytes_notes  # noqa: E402, F401
from step_models import (  # noqa: E402
    GPT_SMALL,
    Method,
    ModelConfig,
    bytes_accessed,
    cpu_model,
    local_adam_step,
    make_loss,
    methods,
    mlp,
    mlp_shapes,
)

import jaxcomm as jc  # noqa: E402
from jaxcomm.optim.zero_one_adam import schedule_for  # noqa: E402

PyTree = Any

#: 0/1 Adam's run length here: long enough that its schedule has all four kinds of step
#: (exact and 1-bit variance steps, then local and synchronising steps after the freeze).
ZERO_ONE_TOTAL_STEPS = 400


def probe_steps(method: Method) -> int:
    """Steps of the tiny run that reach every phase of ``method``'s schedule."""
    if method.name == "zero_one_adam":
        # The interval between syncs doubles (to its cap, 2) after `scaler` syncs.
        freeze, scaler = schedule_for(ZERO_ONE_TOTAL_STEPS, None, None)
        return freeze + 2 * scaler + 4
    return 2 * max(method.warmup, method.cycle) + 2


def phases_of(method: Method, mesh) -> dict[tuple[int, ...], int]:
    """The distinct phase values of ``method``'s steps, each with the first step count that
    runs it, from a tiny model on ``mesh`` (the schedule, not the model, decides them)."""
    params, loss_fn = mlp(2, 16)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, method.make(), params)
    n = mesh.devices.size
    rng = np.random.default_rng(0)
    batch = tuple(rng.standard_normal((2 * n, 16), np.float32) for _ in range(2))
    seen: dict[tuple[int, ...], int] = {}
    for count in range(probe_steps(method)):
        seen.setdefault(tuple(step.phases(state, batch)), count)
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return seen


def abstract_step(mesh, tx, loss_fn: Callable, param_shapes: PyTree, batch_shapes: PyTree):
    """``(step, state, batch)``: ``jc.make_train_step`` on ``mesh`` with its initial state
    traced under ``jax.eval_shape`` (never computed), state and global batch as placed
    ``ShapeDtypeStruct``s."""
    made = {}

    def build(params):
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
        made["step"] = step
        return state

    state = jax.eval_shape(build, param_shapes)
    state = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
        state,
        jc.train_state_specs(state, "dp"),
        is_leaf=lambda x: isinstance(x, P),
    )
    n, split = mesh.devices.size, NamedSharding(mesh, P("dp"))
    batch = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((n * s.shape[0], *s.shape[1:]), s.dtype, sharding=split),
        batch_shapes,
    )
    return made["step"], state, batch


def model_of(args) -> tuple[dict, Callable, PyTree, PyTree]:
    """``(description, loss_fn, parameter shapes, one device's batch shapes)``."""
    if args.model == "gpt":
        cfg = ModelConfig(
            layers=args.layers or GPT_SMALL.layers, width=args.width or GPT_SMALL.width,
            heads=max((args.width or GPT_SMALL.width) // 64, 1), vocab=GPT_SMALL.vocab,
            seq=GPT_SMALL.seq, batch_per_device=args.batch or GPT_SMALL.batch_per_device,
        )  # fmt: skip
        batch = jax.ShapeDtypeStruct((cfg.batch_per_device, cfg.seq + 1), jnp.int32)
        desc = dict(kind="gpt", **cfg.__dict__, parameters=cfg.num_params())
        return desc, make_loss(cfg), cfg.param_shapes(), batch
    layers, width, rows = args.layers or 8, args.width or 4096, args.batch or 512
    shapes = mlp_shapes(layers, width)
    _, loss_fn = mlp(1, 1)  # the loss reads its layers from the parameters it is given
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    desc = dict(kind="mlp", layers=layers, width=width, batch_per_device=rows, dtype="float32",
                parameters=layers * (width * width + width))  # fmt: skip
    return desc, loss_fn, shapes, (x, x)


#: The H100 topology (one host, 8 GPUs; GpuTargetConfig from ``aot_report.H100_CONFIG``).
H100_TOPOLOGY = "h100:1x1x8"


def devices_for(platform_name: str):
    """``(devices, one device)`` to compile for: the simulated CPU devices, or the H100s of
    :data:`H100_TOPOLOGY` (compiled without a GPU)."""
    if platform_name == "cpu":
        cpu = jax.devices()
        return cpu, cpu[0]
    from aot_report import topology

    _, devs = topology(H100_TOPOLOGY)
    return devs, devs[0]


def measures(compiled, platform_name: str) -> dict:
    """The row's measures of ``compiled``: on CPU, ``bytes`` is XLA's cost analysis and
    ``hlo_bytes`` the HLO count beside it (``hlo_bytes_mirror``: the HLO count of exactly
    what the cost analysis charges, its check); on H100 (no cost analysis without a GPU),
    ``bytes`` is the HLO count."""
    text = compiled.as_text()
    hlo = hlo_bytes_accessed(text)
    out = dict(hlo_bytes=hlo, hlo_bytes_mirror=hlo_bytes_accessed(text, mirror=True))
    notes = hlo_bytes_notes(text)
    if notes:
        out["hlo_notes"] = notes
    if platform_name == "cpu":
        out["bytes"] = bytes_accessed(compiled)
        out["cost_analysis"] = out["bytes"]
    else:
        out["bytes"] = hlo
        out["cost_analysis"] = bytes_accessed(compiled)  # None: XLA:GPU without a GPU
    return out


def measure(args) -> dict:
    desc, loss_fn, shapes, batch = model_of(args)
    plat = args.platform
    skips: dict = {}  # every optimizer at its defaults, on both platforms
    table = methods(zero_one_total_steps=ZERO_ONE_TOTAL_STEPS, skips=skips)
    names = args.methods.split(",") if args.methods else list(table)
    report = provenance(desc, plat, skips)
    if getattr(args, "unguarded_residuals", False):  # not the library's step: see --help
        report["unguarded_residuals"] = True
        report["note"] = (
            "Residuals written unconditionally (--unguarded-residuals): what the exact skip "
            "costs, not a usable step. " + report["note"]
        )
    rows: list[dict] = report["rows"]
    devices, first = devices_for(plat)

    local, opt = local_adam_step(loss_fn)
    one = jax.sharding.SingleDeviceSharding(first)
    placed1 = lambda t: jax.tree.map(  # noqa: E731
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), t
    )
    t0 = time.perf_counter()
    compiled = local.lower(
        placed1(shapes), placed1(jax.eval_shape(opt.init, shapes)), placed1(batch)
    ).compile()
    base = measures(compiled, plat)
    if args.breakdown:
        for ins in breakdown(compiled.as_text(), args.breakdown):
            print_instruction("local", ins)
    rows.append(dict(devices=1, method="local", call=table["local"].call, phase="step",
                     phase_values=[], **base, ratio=1.0, hlo_ratio=1.0, target=1.0,
                     compile_s=time.perf_counter() - t0))  # fmt: skip
    write(args.json, report)
    cpu = jax.devices()
    for n in (int(d) for d in args.devices.split(",")):
        if n > len(cpu) or n > len(devices):
            raise SystemExit(f"need {n} devices, have {len(cpu)} (set JAX_NUM_CPU_DEVICES)")
        mesh = jax.sharding.Mesh(np.array(devices[:n]), ("dp",))
        probe_mesh = jax.make_mesh((n,), ("dp",), devices=cpu[:n])
        for name in names:
            method = table[name]
            if method.make is None:
                continue
            step, state, placed = abstract_step(mesh, method.make(), loss_fn, shapes, batch)
            for values, count in phases_of(method, probe_mesh).items():
                label = method.phase_label(values)
                row = dict(devices=n, method=name, call=method.call, phase=label,
                           phase_values=list(values), first_step=count,
                           target=method.target(label))  # fmt: skip
                t0 = time.perf_counter()
                try:
                    compiled = step.program(values).lower(state, placed).compile()
                    row.update(measures(compiled, plat))
                    if args.breakdown:
                        row["top_instructions"] = breakdown(compiled.as_text(), args.breakdown)
                    row["ratio"] = None if row["bytes"] is None else row["bytes"] / base["bytes"]
                    row["hlo_ratio"] = row["hlo_bytes"] / base["hlo_bytes"]
                except Exception as e:  # noqa: BLE001 - the table records any failure
                    row.update(bytes=None, ratio=None, error=f"{type(e).__name__}: {e}"[:2000])
                row["compile_s"] = time.perf_counter() - t0
                row["within_target"] = row["ratio"] is not None and row["ratio"] <= row["target"]
                rows.append(row)
                print_row(row, flush=True)
                for ins in row.get("top_instructions", []):
                    print_instruction("", ins)
                write(args.json, report)
    return report


MEASURES = {
    "cpu": ("compiled.cost_analysis()['bytes accessed'] of each phase's compiled "
            "make_train_step program, per device, over the local optax.adam step's; "
            "hlo_bytes/hlo_ratio: the same programs' bytes counted from their HLO text by "
            "benchmarks/hlo_bytes.py (while bodies times their trip count, no tuple pointer "
            "tables), hlo_bytes_mirror: the HLO count of exactly what the cost analysis "
            "charges"),
    "h100": ("bytes accessed per device counted from the compiled HLO text by "
             "benchmarks/hlo_bytes.py (XLA:GPU has no cost analysis without a GPU) of each "
             "phase's make_train_step program compiled for " + H100_TOPOLOGY + " (no GPU), "
             "over the same count of the local optax.adam step compiled for one H100"),
}  # fmt: skip


NOTES = {
    "cpu": "XLA:CPU cost analysis; hlo_bytes beside it.",
    "h100": (f"Compiled for {H100_TOPOLOGY} without a GPU; HLO count both sides (no cost "
             "analysis); every optimizer at its defaults."),
}  # fmt: skip


def provenance(model: dict, platform_name: str = "cpu", skips: dict | None = None) -> dict:
    if platform_name == "cpu":
        kind = jax.devices()[0].device_kind
    else:
        kind = devices_for(platform_name)[1].device_kind
    git = _git()
    return dict(
        command=" ".join(["python", *sys.argv]),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions=dict(python=platform.python_version(), jax=jax.__version__,
                      jaxlib=_version("jaxlib"), optax=_version("optax"),
                      jax_cuda12_plugin=_version("jax-cuda12-plugin")),  # fmt: skip
        machine=dict(platform=platform.platform(), processor=platform.machine(), cpu=cpu_model(),
                     cpus=os.cpu_count(), backend=jax.default_backend(),
                     device_kind=jax.devices()[0].device_kind),  # fmt: skip
        target=dict(platform=platform_name, device_kind=kind,
                    topology=None if platform_name == "cpu" else H100_TOPOLOGY,
                    compiled_without_device=platform_name != "cpu",
                    optimizer_arguments=dict(skips or {})),  # fmt: skip
        git=git,
        commit=git["commit"],
        note=NOTES[platform_name],  # git["changed"]: files that differed from the commit
        model=model,
        measure=MEASURES[platform_name],
        rows=[],
    )  # fmt: skip


def _git() -> dict:
    """The commit measured, and the paths the working tree changed (the programs compiled
    are the working tree's)."""
    import subprocess

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=30,
                                  cwd=Path(__file__).resolve().parent).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return ""

    status = run("status", "--porcelain", "-z").split("\0")
    changed = [e[3:] for e in status if len(e) > 3]
    return dict(commit=run("rev-parse", "HEAD").strip() or None, changed=changed)


def _version(pkg: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def write(path: str | None, report: dict) -> None:
    if path:  # after every row: an interrupted run keeps what it measured
        Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")


HEAD = (f"{'dev':>3}  {'method':<14}{'phase':<16}{'bytes':>10}{'ratio':>8}{'target':>8}  ok"
        f"{'hlo':>6}{'hlo ratio':>10}")  # fmt: skip


def print_row(r: dict, flush: bool = False) -> None:
    gb = "-" if r.get("bytes") is None else f"{r['bytes'] / 1e9:.3f} GB"
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
    ok = "" if r["method"] == "local" else ("yes" if r.get("within_target") else "NO")
    if r.get("error"):
        ok = "error: " + r["error"][:60]
    hlo = "-" if r.get("hlo_bytes") is None else f"{r['hlo_bytes'] / 1e9:.3f} GB"
    hr = "-" if r.get("hlo_ratio") is None else f"{r['hlo_ratio']:.2f}x"
    print(f"{r['devices']:>3}  {r['method']:<14}{r['phase']:<16}{gb:>10}{ratio:>8}"
          f"{r['target']:>7.2f}x  {ok:<4}{hlo:>10}{hr:>8}", flush=flush)  # fmt: skip


def print_instruction(prefix: str, ins: dict) -> None:
    print(f"{prefix:<7}{ins['bytes'] / 1e9:8.3f} GB  {ins['op']:<22}{ins['shape'][:34]:<36}"
          f"{ins['op_name']}")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--layers", type=int, default=None, help="default: 8 (MLP), 12 (GPT)")
    p.add_argument("--width", type=int, default=None, help="default: 4096 (MLP), 768 (GPT)")
    p.add_argument("--batch", type=int, default=None, help="rows per device (512 MLP, 8 GPT)")
    p.add_argument("--devices", default="2,8", help="data-parallel sizes to compile for")
    p.add_argument("--methods", default=None, help="comma-separated (default: all)")
    p.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="N",
        help="also list each program's N largest instructions by bytes",
    )
    p.add_argument(
        "--platform",
        choices=("cpu", "h100"),
        default="cpu",
        help="cpu: compile for JAX_NUM_CPU_DEVICES CPU devices and use XLA's cost "
        f"analysis; h100: compile for {H100_TOPOLOGY} without a GPU (needs "
        "jax[cuda12]) and count the HLO (benchmarks/hlo_bytes.py)",
    )
    p.add_argument(
        "--unguarded-residuals",
        action="store_true",
        help="what the exact skip costs: the staged codecs write their new residuals "
        "unconditionally (jaxcomm.compressors.staged.settle replaced; a NaN would poison "
        "them), for comparison only",
    )
    p.add_argument("--json", metavar="OUT", default=None)
    args = p.parse_args(argv)
    if args.unguarded_residuals:
        import jaxcomm.compressors.staged as staged
        import jaxcomm.fusion as fusion

        # The verdict after the exchange everywhere, and no residual kept by it.
        fusion.verdict_first = lambda first, after, *operands: after(*operands)
        staged.verdict_first = fusion.verdict_first
        staged.settle = lambda codec, finite, received_ok, new, old: new
    model, *_ = model_of(args)
    print(f"model: {model}; platform {args.platform}, jax {jax.__version__}")
    print(HEAD)
    report = measure(args)
    print_row(report["rows"][0])
    print("\nsorted:")
    print(HEAD)
    for r in sorted(report["rows"], key=lambda r: (r["devices"], r["method"] != "local")):
        print_row(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
