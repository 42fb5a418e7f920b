"""One check to run on an NVIDIA GPU machine, one GPU or several (``--budget-s`` bounds its time).

It prints, with the XLA flags it ran under (``jc.xla_flags("gpu", combine_threshold_bytes=B)``
with ``B`` the bucket size, set before JAX starts):

1. **Stages**: compress and decompress throughput of OneBit (pack signs + scale + worker
   residual; unpack scaled signs) and int8 (blockwise absmax quantization; dequantization) on
   one device, as GB/s of bytes read plus written, against the device's copy bandwidth
   (``y = x + 1`` over the same buffer, read + write), and the bytes each stage's compiled
   program moves over that minimum ("x minimum": a stage whose program reads its input twice
   cannot pass half the copy bandwidth, whatever its kernels). ``--stage-bytes TOPOLOGY``
   compiles only these programs for a topology without its device (``h100:1x1x8``) and
   prints that measure.
2. **Overlap**: ``benchmarks/overlap_gpu.py`` (bucketed OneBit mean inside a backward pass,
   with and without the latency-hiding flags), on every GPU present (needs >= 2).
3. **1-bit Adam against exact Adam**: ``jc.make_train_step`` with ``jc.onebit_adam`` (its
   compressed phase, after the freeze) and with an exact mean + ``optax.adam``, on an MLP data
   parallel over every GPU present: median step times, the wire bytes of both compiled steps,
   the share of collective bytes with compute scheduled inside their
   async window (read from the compiled schedule), and a correctness check: during 1-bit
   Adam's warm-up the two optimizers are the same algorithm, so their parameters must agree.
   On one device every collective is a local no-op: the times are then the compression's
   compute and memory cost with a free wire, not a multi-GPU speed.
4. **The whole train step, the README's calls**: every optimizer of ``step_models.methods``
   (default arguments, short warm-ups so that a few steps reach the steady phases) through
   ``jc.make_train_step`` on ``jax.make_mesh((n,), ("dp",))`` over every GPU present, against
   a local ``optax.adam`` step (plain ``jax.jit``, donated) on one device's batch; on a
   GPT-style LM (12 layers, d 768, 12 heads, sequence 1024, 8 sequences per device,
   vocabulary 32768; bf16 matmuls, fp32 parameters) and on an 8 x 4096^2 fp32 MLP (512 rows
   per device). Per row: the step time after the warm-up (median; for DiLoCo and 0/1 Adam the
   mean over whole cycles of their steady phases: one sync every 16 steps, and sync / local
   steps alternating), its ratio to the local step, XLA's bytes accessed of the step's
   compiled program (cost analysis, per device; averaged over the timed steps' phases), the
   seconds to build, compile and run the warm-up, how many programs were compiled after the
   first step (and inside the timed window), and the final loss (the data are two random
   batches repeated: a speed test; with warm-ups this short 1-bit Adam may diverge).
   ``--budget-s`` (default 360) bounds the whole run's wall time: a row whose expected time
   (a multiple of the local row's on the same model, the larger of a prior and the multiple
   seen on the previous model) would end past it is skipped and
   recorded as skipped; the rows run most important first, the LM's before the MLP's. The
   last row, ``onebit_adam_cap_in_program``, is 1-bit Adam again with its skip cap checked in
   the program (``check_skips_on_host=False``: a conditional host callback, which copies its
   predicate to the host and blocks it every step) instead of on the host: what that costs.

``--json OUT`` is rewritten after every section and row, so an interrupted run keeps what it
measured. ``--cpu`` runs the same code on 8 simulated CPU devices at small sizes (what the
test suite does, so the script cannot rot); CPU figures measure nothing about a GPU.

Usage::

    python benchmarks/gpu_check.py [--json OUT]           # on the GPU machine
    python benchmarks/gpu_check.py --cpu --small          # smoke run anywhere
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform as platform_module
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, str(p))

#: Sizes (default: one H100 node; small: the CPU test).
SIZES = {
    "default": dict(stage_mb=256, layers=16, width=4096, batch=64, bucket_mb=32, steps=20,
                    overlap=["--layers", "24", "--width", "4096", "--batch", "64",
                             "--bucket-mb", "16", "--repeats", "10"]),
    "small": dict(stage_mb=1, layers=3, width=64, batch=4, bucket_mb=0.01, steps=3,
                  overlap=["--layers", "2", "--width", "64", "--batch", "4",
                           "--bucket-mb", "0.01", "--repeats", "2"]),
}  # fmt: skip
FREEZE = 3  # 1-bit Adam's warm-up steps (exact Adam) before the compressed phase


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="8 simulated CPU devices (smoke run)")
    p.add_argument("--small", action="store_true", help="small sizes (the CPU test's)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per stage/step")
    p.add_argument("--skip-overlap", action="store_true", help="skip section 2")
    p.add_argument("--sections", default="1,2,3,4", help="which sections to run")
    p.add_argument("--train-models", default="gpt,mlp", help="section 4's models, in order")
    p.add_argument("--train-methods", default=",".join(TRAIN_ORDER),
                   help="section 4's rows, in order (local first: the others' baseline)")
    p.add_argument("--train-steps", type=int, default=10, help="timed steps per row (section 4)")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="wall seconds for the whole run: section 4 skips rows past it")
    p.add_argument("--stage-bytes", metavar="TOPOLOGY", default=None,
                   help="only compile section 1's stages for TOPOLOGY (e.g. h100:1x1x8) "
                   "without its device and print the bytes they move against the minimum")
    p.add_argument("--json", metavar="OUT")
    return p.parse_args(argv)


def setup_env(cpu: bool, bucket_bytes: int) -> str:
    """Sets the platform and ``XLA_FLAGS`` before JAX starts; returns the flags."""
    if cpu:  # before jaxcomm imports jax, which reads these once
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
        return os.environ.get("XLA_FLAGS", "")
    import jaxcomm as jc

    os.environ["XLA_FLAGS"] = jc.xla_flags("gpu", combine_threshold_bytes=bucket_bytes)
    return os.environ["XLA_FLAGS"]


def median_seconds(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# 1. Stages: (function, bytes read + written for n fp32 inputs).


def stage_functions(block: int = 2048) -> dict:
    """name -> (make_input(x), jitted stage, bytes moved for ``n`` input elements)."""
    import jax
    import jax.numpy as jnp

    from jaxcomm.compressors.quantize import quantize_blocks
    from jaxcomm.compressors.signs import pack_signs, scaled_signs

    def onebit_compress(x):
        scale = jnp.sqrt(jnp.sum(jnp.square(x))) / jnp.sqrt(float(x.size))
        error = x - scale * jnp.where(x >= 0, 1.0, -1.0)
        return pack_signs(x), scale, error

    def onebit_decompress(packed, scale):
        return scaled_signs(packed, scale)

    def int8_compress(x):
        return quantize_blocks(x.reshape(-1, block), 8)

    def int8_decompress(q, inv):
        return (q.astype(jnp.float32) * inv[:, None]).reshape(-1)

    def ident(x):
        return (x,)

    return {
        # name: (inputs from x, fn, bytes read + written for n fp32 elements)
        "copy (x + 1)": (ident, jax.jit(lambda x: x + 1.0), lambda n: 8 * n),
        "onebit compress": (ident, jax.jit(onebit_compress), lambda n: 4 * n + n // 8 + 4 * n),
        "onebit decompress": (
            lambda x: jax.jit(onebit_compress)(x)[:2],
            jax.jit(onebit_decompress),
            lambda n: n // 8 + 4 * n,
        ),
        "int8 compress": (ident, jax.jit(int8_compress), lambda n: 4 * n + n + 4 * (n // block)),
        "int8 decompress": (
            lambda x: jax.jit(int8_compress)(x),
            jax.jit(int8_decompress),
            lambda n: n + 4 * (n // block) + 4 * n,
        ),
    }


def stage_elements(size_mb: float) -> int:
    return max(int(size_mb * 2**20 / 4) // 2048 * 2048, 2048)


def compiled_stage_bytes(device, n: int) -> dict[str, dict]:
    """Per stage, the bytes its program compiled for ``device`` moves (the HLO count of
    ``benchmarks/hlo_bytes.py``) and that over the least it must read and write
    (``over_minimum``; 1.0: one pass). Compile only: ``device`` may be one of a topology
    compiled without its hardware. A stage whose program moves k times its minimum runs at
    most at 1/k of the copy bandwidth as the minimum counts it."""
    import jax
    from hlo_bytes import hlo_bytes_accessed
    from jax.sharding import SingleDeviceSharding

    x = jax.ShapeDtypeStruct((n,), jax.numpy.float32)
    out = {}
    for name, (inputs, fn, moved) in stage_functions().items():
        shapes = jax.eval_shape(inputs, x)
        shapes = shapes if isinstance(shapes, tuple) else (shapes,)
        placed = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
            for a in shapes
        ]
        text = fn.lower(*placed).compile().as_text()
        hlo = hlo_bytes_accessed(text)
        out[name] = dict(hlo_bytes=hlo, over_minimum=hlo / moved(n))
    return out


def run_stages(size_mb: float, repeats: int) -> list[dict]:
    import jax

    n = stage_elements(size_mb)
    dev = jax.devices()[0]
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n,)), dev)
    compiled = compiled_stage_bytes(dev, n)
    rows = []
    for name, (inputs, fn, moved) in stage_functions().items():
        args = inputs(x)
        secs = median_seconds(fn, *args, repeats=repeats)
        rows.append(dict(stage=name, elements=n, seconds=secs, bytes=moved(n),
                         gbps=moved(n) / secs / 1e9, **compiled[name]))  # fmt: skip
    copy = rows[0]["gbps"]
    for r in rows:
        r["of_copy"] = r["gbps"] / copy
    return rows


def stage_bytes_without_device(
    topology_name: str, size_mb: float, out: str | None, argv: list[str] | None = None
) -> int:
    """``--stage-bytes TOPOLOGY``: section 1's programs compiled for the topology's first
    device with no accelerator attached (``benchmarks/aot_report.py``'s topologies, e.g.
    ``h100:1x1x8``), their bytes against the minimum; nothing runs."""
    from aot_report import topology
    from step_models import cpu_model

    _, devices = topology(topology_name)
    n = stage_elements(size_mb)
    rows = compiled_stage_bytes(devices[0], n)
    minimum = {name: moved(n) for name, (_, _, moved) in stage_functions().items()}
    print(f"section 1's stages compiled for {topology_name} ({devices[0].device_kind}), "
          f"{size_mb:g} MiB fp32, not run")  # fmt: skip
    print(f"{'stage':<20}{'moved MB':>10}{'minimum MB':>12}{'x minimum':>11}")
    for name, r in rows.items():
        print(f"{name:<20}{r['hlo_bytes'] / 1e6:>10.1f}{minimum[name] / 1e6:>12.1f}"
              f"{r['over_minimum']:>11.2f}")  # fmt: skip
    if out:
        doc = {
            **_header(argv),
            "topology": topology_name,
            "device_kind": devices[0].device_kind,
            "elements": n,
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
            "note": f"Section 1's programs compiled for {topology_name} without the device; "
            "bytes moved against the minimum, nothing run.",
            "measure": "bytes read and written by each stage's program compiled without the "
            "device (benchmarks/hlo_bytes.py), over the least the stage must read and write",
            "stages": {name: dict(r, minimum_bytes=minimum[name]) for name, r in rows.items()},
        }
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# 3. 1-bit Adam against exact Adam on every device present.


def mlp(layers: int, width: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), layers)
    params = {f"w{i:02d}": jax.random.normal(k, (width, width)) / width**0.5
              for i, k in enumerate(keys)}  # fmt: skip

    def loss(p, x):
        h = x
        for name in sorted(p):
            h = jax.nn.gelu(h.astype(jnp.bfloat16) @ p[name].astype(jnp.bfloat16))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return params, loss


def optimizers(bucket: int) -> dict:
    import optax

    import jaxcomm as jc

    return {
        "exact Adam": optax.chain(
            jc.compressed_mean("dp", jc.NoCompression(), bucket), optax.adam(1e-3)
        ),
        "1-bit Adam": jc.onebit_adam(1e-3, freeze_step=FREEZE, axis_name="dp", bucket_bytes=bucket),
    }


def run_steps(layers: int, width: int, batch: int, bucket: int, steps: int) -> dict:
    """Warm-up agreement, then median step time of each optimizer's steady phase."""
    import jax
    import numpy as np
    from aot_report import analyse

    import jaxcomm as jc

    devices = jax.devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    params, loss = mlp(layers, width)
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((n * batch, width), np.float32) for _ in range(4)]
    out: dict = {"devices": n, "platform": devices[0].platform, "device_kind":
                 devices[0].device_kind, "parameters": layers * width * width}  # fmt: skip
    warm: dict = {}
    for name, tx in optimizers(bucket).items():
        step, state = jc.make_train_step(mesh, "dp", loss, tx, params)
        for i in range(FREEZE):  # warm-up: identical algorithms
            state, _ = step(state, batches[i % len(batches)])
        warm[name] = jax.tree.map(np.asarray, jc.params_of(state))
        for i in range(2):  # into the steady (compressed) phase, compiled
            state, _ = step(state, batches[i % len(batches)])
        phases = step.phases(state, batches[0])
        placed = jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype, sharding=split)
        compiled = step.program(phases).lower(state, placed).compile()
        sched = analyse(compiled.as_text(), list(mesh.devices.flat))
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, lval = step(state, batches[i % len(batches)])
            jax.block_until_ready(lval)  # one step at a time: the step's own latency
            times.append(time.perf_counter() - t0)
        out[name] = dict(
            median_s=statistics.median(times), phases=list(phases),
            wire_bytes=sched["wire_bytes"], collectives=len(sched["collectives"]),
            async_pairs=sched["async_pairs"], overlap_fraction=sched["overlap_fraction"],
            loss=float(lval),
        )  # fmt: skip
    diffs = [
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(warm["exact Adam"]), jax.tree.leaves(warm["1-bit Adam"]),
                        strict=True)
    ]  # fmt: skip
    out["warmup_max_abs_diff"] = max(diffs)
    out["speedup"] = out["exact Adam"]["median_s"] / out["1-bit Adam"]["median_s"]
    return out


# ---------------------------------------------------------------------------------------------
# 4. The whole train step, the README's calls with default arguments.

#: Section 4's rows, most important first (a run out of budget skips the last ones).
TRAIN_ORDER = ("local", "exact", "onebit_adam", "int8_ef", "zero_one_adam", "diloco", "demo",
               "onebit_lamb", "onebit_adam_cap_in_program")  # fmt: skip
#: Rows that are another row's optimizer with other ``make_train_step`` options: 1-bit Adam
#: with its skip cap checked in the program (a conditional host callback every step, which on
#: a GPU copies its predicate to the host and blocks it) instead of on the host (the default
#: on GPU): what that check costs a step.
ROW_VARIANTS = {"onebit_adam_cap_in_program": ("onebit_adam", {"check_skips_on_host": False})}
#: A row's build, compile and warm-up seconds as a multiple of the local row's on the same model
#: (its programs to compile: 1-bit Adam three, 0/1 Adam up to four; from the first H200 run),
#: to skip a row that would end past the budget before starting it.
ROW_COST = {"local": 1.0, "exact": 1.0, "int8_ef": 1.0, "int4_ef": 1.0, "onebit_adam": 2.8,
            "zero_one_adam": 3.8, "diloco": 1.9, "demo": 1.9, "onebit_lamb": 2.8,
            "onebit_adam_cap_in_program": 2.8}  # fmt: skip
#: Learning rates: the LM's usual 3e-4; the MLP's 1e-3.
TRAIN_LR = {"gpt": 3e-4, "mlp": 1e-3}


class CompileCounter:
    """Counts XLA compiles (JAX's backend-compile duration events) from its creation on."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    _instance: CompileCounter | None = None

    def __init__(self) -> None:
        import jax.monitoring

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1

    @classmethod
    def get(cls) -> CompileCounter:
        if cls._instance is None:  # one listener per process (JAX cannot remove one)
            cls._instance = cls()
        return cls._instance


def train_models(small: bool) -> dict:
    """name -> a function building ``(description, params, loss_fn, one device's batches)``
    (two batches, used in turn)."""
    import jax
    from step_models import GPT_SMALL, GPT_TINY, make_loss, mlp, mlp_batch

    out = {}
    cfg = GPT_TINY if small else GPT_SMALL

    def gpt():
        batches = [cfg.batch(cfg.batch_per_device, seed) for seed in (0, 1)]
        desc = dict(cfg.__dict__, parameters=cfg.num_params(), dtype="fp32 params, bf16 matmuls")
        return desc, cfg.init(jax.random.key(0)), make_loss(cfg), batches

    layers, width, rows = (2, 64, 8) if small else (8, 4096, 512)

    def mlp_model():
        params, loss_fn = mlp(layers, width)
        batches = [mlp_batch(rows, width, seed) for seed in (0, 1)]
        desc = dict(layers=layers, width=width, batch_per_device=rows, dtype="float32",
                    parameters=layers * (width * width + width))  # fmt: skip
        return desc, params, loss_fn, batches

    out["gpt"], out["mlp"] = gpt, mlp_model
    return out


def _stack_rows(batch, n: int):
    """One device's batch repeated for ``n`` devices (the global batch)."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: np.concatenate([x] * n), batch)


def train_row(
    method, mesh, params, loss_fn, batches, lr: float, steps: int, options: dict | None = None
) -> dict:
    """Build, warm up and time one optimizer's step (see section 4 of the module docstring);
    ``options``: extra ``jc.make_train_step`` arguments."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from step_models import bytes_accessed, local_adam_step

    import jaxcomm as jc

    counter = CompileCounter.get()
    n = mesh.devices.size
    cycle = method.cycle
    timed = -(-max(steps, cycle) // cycle) * cycle  # whole cycles of the steady phases
    t0 = time.perf_counter()
    c0 = counter.count
    if method.make is None:  # the baseline: one device, one device's batch
        dev = mesh.devices.flat[0]
        fn, opt = local_adam_step(loss_fn, lr)
        # Copies: the step donates them, and device_put may alias the caller's arrays.
        own = jax.tree.map(lambda x: jnp.array(jax.device_put(x, dev), copy=True), params)
        carry = [own, jax.device_put(opt.init(own), dev)]  # committed, as the step returns
        placed = [jax.device_put(b, dev) for b in batches]
        step_obj = None

        def run(i):
            carry[0], carry[1], loss = fn(carry[0], carry[1], placed[i % 2])
            return loss

        def lower():
            return fn.lower(carry[0], carry[1], placed[0])
    else:
        step_obj, state = jc.make_train_step(
            mesh, "dp", loss_fn, method.make(), params, **(options or {})
        )
        split = NamedSharding(mesh, P("dp"))
        placed = [jax.device_put(_stack_rows(b, n), split) for b in batches]  # placed once
        carry = [state]

        def run(i):
            carry[0], loss = step_obj(carry[0], placed[i % 2])
            return loss

        def lower():
            return step_obj.lower(carry[0], placed[0])

    loss = jax.block_until_ready(run(0))
    first_s = time.perf_counter() - t0
    c1 = counter.count
    for i in range(1, method.warmup):
        loss = run(i)
    jax.block_until_ready(loss)
    warm_s = time.perf_counter() - t0
    c2 = counter.count
    times, ran = [], []
    phased = step_obj is not None and step_obj.phased is not None
    for i in range(method.warmup, method.warmup + timed):
        t = time.perf_counter()
        loss = jax.block_until_ready(run(i))  # one step at a time: the step's own latency
        times.append(time.perf_counter() - t)
        ran.append(tuple(step_obj.last_phases) if phased else ())
    c3 = counter.count
    # Bytes accessed of each phase's compiled program, from jit's cache (no new compile: if
    # one happens after all, the other phases are left out, to keep within the budget).
    per_phase: dict[tuple, float | None] = {}
    for values in dict.fromkeys(ran):
        before, t = counter.count, time.perf_counter()
        if phased:
            compiled = step_obj.program(values).lower(carry[0], placed[0]).compile()
        else:
            compiled = lower().compile()
        per_phase[values] = bytes_accessed(compiled)
        if counter.count > before or time.perf_counter() - t > 2.0:  # 2 s: not from a cache
            break
    known = [per_phase[v] for v in ran if per_phase.get(v) is not None]
    accessed = statistics.fmean(known) if len(known) == len(ran) else None
    amortised = cycle > 1
    step_s = statistics.fmean(times) if amortised else statistics.median(times)
    out = dict(
        method=method.name, call=method.call, devices=n, step_ms=step_s * 1e3,
        step_is="mean over whole cycles" if amortised else "median",
        median_ms=statistics.median(times) * 1e3, max_ms=max(times) * 1e3,
        times_ms=[t * 1e3 for t in times], warmup_steps=method.warmup, timed_steps=timed,
        bytes_accessed=accessed, first_step_s=first_s, compile_and_warmup_s=warm_s,
        bytes_accessed_by_phase={method.phase_label(v): b for v, b in per_phase.items()},
        compiles_first_step=c1 - c0, compiles_after_first_step=c3 - c1,
        compiles_in_timed_window=c3 - c2, final_loss=float(loss),
        loss_finite=bool(np.isfinite(float(loss))),
    )  # fmt: skip
    if counter.count == 0:  # this JAX reports no compile events: the counts are unknown
        for key in ("compiles_first_step", "compiles_after_first_step",
                    "compiles_in_timed_window"):  # fmt: skip
            out[key] = None
    if phased:
        out["step_compile_count"] = getattr(step_obj.phased, "compile_count", None)
        out["phases_compiled"] = [list(v) for v in step_obj.compiled_phases]
        out["phase_labels"] = [method.phase_label(v) for v in step_obj.compiled_phases]
    carry.clear()  # free the state before the next row
    return out


def run_train_rows(args, small: bool, t_start: float, record) -> dict:
    """Section 4: every (model, method) row within the budget; ``record()`` saves progress."""
    import jax
    from step_models import methods

    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("dp",))
    models = train_models(small)
    out: dict = {"devices": n, "models": {}, "rows": [], "budget_s": args.budget_s}
    order = [m for m in args.train_methods.split(",") if m]
    print(f"{'model':<5} {'method':<14}{'step ms':>9}{'vs local':>9}{'accessed':>11}"
          f"{'vs local':>9}{'warm s':>8}{'compiles':>9}{'loss':>11}")  # fmt: skip
    seen: dict[str, float] = {}  # a row's time over its model's local row's, on earlier models
    for model_name in [m for m in args.train_models.split(",") if m]:
        desc, params, loss_fn, batches = models[model_name]()
        out["models"][model_name] = desc
        table = methods(TRAIN_LR[model_name])
        base: dict | None = None
        for name in order:
            base_name, options = ROW_VARIANTS.get(name, (name, {}))
            method = table[base_name]
            elapsed = time.perf_counter() - t_start
            factor = max(ROW_COST.get(name, 3.0), seen.get(name, 0.0))
            guess = None if base is None else factor * base["row_s"]
            call = method.call + "".join(f", {k}={v!r}" for k, v in options.items())
            row: dict = dict(model=model_name, method=name, call=call)
            if elapsed > args.budget_s or (guess is not None and elapsed + guess > args.budget_s):
                row.update(skipped=f"budget: {elapsed:.0f} s of {args.budget_s:.0f} s used"
                           + ("" if guess is None else f", this row needs ~{guess:.0f} s"))
                out["rows"].append(row)
                print(f"{model_name:<5} {name:<14} skipped ({row['skipped']})")
                record()
                continue
            t_row = time.perf_counter()
            try:
                row.update(train_row(method, mesh, params, loss_fn, batches,
                                     TRAIN_LR[model_name], args.train_steps, options))  # fmt: skip
                row.update(method=name, call=call)  # a variant's own name and call
            except Exception as e:  # noqa: BLE001 - the report records any failure
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            gc.collect()  # the row's state and programs, before the next row allocates
            row["row_s"] = time.perf_counter() - t_row
            if name == "local" and "error" not in row:
                base = row
            if base is not None and "error" not in row:
                seen[name] = row["row_s"] / base["row_s"]
            if base is not None and "step_ms" in row:
                row["ratio"] = row["step_ms"] / base["step_ms"]
                if row.get("bytes_accessed") and base.get("bytes_accessed"):
                    row["bytes_ratio"] = row["bytes_accessed"] / base["bytes_accessed"]
            out["rows"].append(row)
            print_train_row(row)
            record()
        del params, batches
    return out


def _gb(b) -> str:
    if b is None:
        return "-"
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def print_train_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['model']:<5} {r['method']:<14} error: {r['error'][:200]}")
        return
    ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
    bratio = f"{r['bytes_ratio']:.2f}x" if "bytes_ratio" in r else "-"
    compiles = f"{r['compiles_after_first_step']}/{r['compiles_in_timed_window']}"
    if r["compiles_after_first_step"] is None:
        compiles = "?"
    print(f"{r['model']:<5} {r['method']:<14}{r['step_ms']:>9.2f}{ratio:>9}"
          f"{_gb(r['bytes_accessed']):>11}{bratio:>9}{r['compile_and_warmup_s']:>8.1f}"
          f"{compiles:>9}{r['final_loss']:>11.4g}", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 2. Overlap: benchmarks/overlap_gpu.py in its own processes (it sets XLA_FLAGS per mode).


def run_overlap(extra: list[str], cpu: bool) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "overlap.json")
        cmd = [sys.executable, str(REPO / "benchmarks" / "overlap_gpu.py"), *extra, "--json", out]
        if cpu:
            cmd.append("--allow-cpu")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout.rstrip())
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            return {"error": f"overlap_gpu.py exited {proc.returncode}"}
        if not os.path.exists(out):
            return None  # skipped (fewer than 2 GPUs)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    args = _parse(argv)
    size = SIZES["small" if args.small else "default"]
    bucket = int(size["bucket_mb"] * 2**20)
    if args.stage_bytes:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return stage_bytes_without_device(args.stage_bytes, size["stage_mb"], args.json, argv)
    flags = setup_env(args.cpu, bucket)
    import jax

    import jaxcomm as jc

    t_start = time.perf_counter()
    CompileCounter.get()  # listening before the first compile
    devices = jax.devices()
    if not args.cpu and devices[0].platform != "gpu":
        print(f"no GPU: JAX sees {devices[0].platform} devices (use --cpu for a smoke run)")
        return 1
    sections = {s.strip() for s in args.sections.split(",")}
    repeats = args.repeats or (3 if args.small else 20)
    kind, platform = devices[0].device_kind, devices[0].platform
    print(f"{len(devices)} x {kind} ({platform}), jax {jax.__version__}")
    print(f"XLA_FLAGS={flags!r}")
    if args.cpu:
        gpu_flags = jc.xla_flags("gpu", combine_threshold_bytes=bucket)
        print(f"(the GPU run sets XLA_FLAGS={gpu_flags!r})")
    result: dict = {**_header(argv), "xla_flags": flags, "devices": len(devices),
                    "device_kind": devices[0].device_kind, "platform": platform,
                    "sizes": size, "sections": sorted(sections)}  # fmt: skip

    def record() -> None:
        result["wall_s"] = time.perf_counter() - t_start
        if args.json:  # after every section and row: an interrupted run keeps its results
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    record()
    one = len(devices) < 2
    if "1" in sections:
        print(f"\n1. compress / decompress on one device, {size['stage_mb']} MiB fp32 buffers")
        stages = run_stages(size["stage_mb"], repeats)
        print(f"{'stage':<20}{'ms':>10}{'GB/s':>10}{'of copy':>9}{'x minimum':>11}")
        for r in stages:
            print(f"{r['stage']:<20}{r['seconds'] * 1e3:>10.3f}{r['gbps']:>10.1f}"
                  f"{r['of_copy']:>9.0%}{r['over_minimum']:>11.2f}")  # fmt: skip
        result["stages"] = stages
        record()

    if "2" in sections:
        print("\n2. overlap of bucketed collectives with the backward pass (overlap_gpu.py)")
        if one:  # its own processes would initialise the one GPU a second time, to no end
            print("skipped: needs >= 2 devices")
        skip = args.skip_overlap or one
        result["overlap"] = None if skip else run_overlap(size["overlap"], args.cpu)
        record()

    if "3" in sections:
        what = ("one device: collectives are local no-ops, so this measures the compression's "
                "compute and memory cost with a free wire" if one else
                f"{len(devices)} devices: compression and the wire")  # fmt: skip
        print(f"\n3. 1-bit Adam against exact Adam, {size['layers']} x {size['width']}^2 MLP, "
              f"bucket {bucket} B ({what})")  # fmt: skip
        steps = run_steps(size["layers"], size["width"], size["batch"], bucket, size["steps"])
        steps["measures"] = what
        print(f"{'optimizer':<12}{'phase':>14}{'step ms':>10}{'wire/dev':>12}{'async':>8}"
              f"{'overlap':>9}")  # fmt: skip
        for name in ("exact Adam", "1-bit Adam"):
            r = steps[name]
            ov = "-" if r["overlap_fraction"] is None else f"{r['overlap_fraction']:.0%}"
            print(f"{name:<12}{str(tuple(r['phases'])):>14}{r['median_s'] * 1e3:>10.2f}"
                  f"{r['wire_bytes']:>12.0f}"
                  f"{str(r['async_pairs']) + '/' + str(r['collectives']):>8}{ov:>9}")  # fmt: skip
        print(f"1-bit Adam speed-up over exact: {steps['speedup']:.2f}x; warm-up parameters "
              f"agree to {steps['warmup_max_abs_diff']:.2e}")  # fmt: skip
        result["train_step"] = steps
        record()

    if "4" in sections:
        print(f"\n4. the whole train step, the README's calls with default arguments, "
              f"{len(devices)} device(s) on 'dp' against a local optax.adam step"
              + (" (one device: no wire; compression compute and memory only)" if one else ""))
        print("(step ms: median, or the mean over whole cycles for diloco and zero_one_adam; "
              "accessed: XLA's bytes accessed per step; compiles: after step 1 / in the timed "
              "window)")  # fmt: skip
        result["train_steps"] = {}
        result["train_steps"] = run_train_rows(args, args.small, t_start, record)
        record()

    record()
    print(f"\ntotal {result['wall_s']:.0f} s")
    if args.cpu:
        print("(CPU smoke run: these figures say nothing about a GPU)")
    return 0


def _header(argv: list[str] | None) -> dict:
    """A results file's command (``argv`` as given to :func:`main`, else this process's), date
    and versions."""
    return {
        "command": " ".join(["python", *sys.argv]) if argv is None else argv,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
    }


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform_module.python_version()}
    for pkg in ("jaxcomm", "jax", "jaxlib", "optax", "flax"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
