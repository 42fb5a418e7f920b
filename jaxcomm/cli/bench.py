"""``jaxcomm bench``: nccl-tests / DeepSpeed ``ds_bench`` for jaxcomm's collectives.

For every op, compressor and message size it times the jitted collective (median of
``repeats`` runs after a warm-up) and reads the compiled program's HLO for the bytes each device
sends. Columns, with ``S`` the message size (uncompressed bytes), ``t`` the median time and
``n`` the number of devices (DeepSpeed's and nccl-tests' conventions):

==============  ===============================================================================
``algbw``       ``S / t``: the *effective* bandwidth, uncompressed bytes over time
``busbw``       ``algbw * 2(n-1)/n`` for all_reduce, ``algbw * (n-1)/n`` for reduce_scatter,
                all_gather and all_to_all: what an uncompressed ring would need from each link
                to be this fast (for a compressor it can exceed the link's rate)
``wire/dev``    bytes each device sends per call, read from the compiled HLO
``wire GB/s``   ``wire/dev / t``: what the link actually carried
``error``       relative L2 error of one call against the exact collective (NumPy)
``compute``     with ``--no-network``: the same op on this process's device alone (an axis of
                size 1, so no link and no collective): the cost of compressing and
                decompressing, to read against ``time``
==============  ===============================================================================

Ops are timed the way a train step runs them: the error-feedback state is donated to each call
and the returned state carried into the next (as ``jc.make_train_step`` does), so outputs reuse
the state's buffers instead of fresh allocations.

Sizes: ``S`` is the per-device buffer for all_reduce and all_to_all, the full (gathered or
pre-scatter) buffer for all_gather and reduce_scatter (nccl-tests' convention), all fp32, rounded
up to a multiple of ``4 n`` bytes. all_reduce and reduce_scatter are means (``compressed_pmean``,
``compressed_pmean_scatter``), all_gather is ``compressed_all_gather``, and all_to_all is the
exact ``lax.all_to_all`` (no compressor implements it), run for the ``none`` compressor only.

Compressors are found by name in :func:`compressor_registry`: every :class:`jaxcomm.Compressor`
subclass that ``jaxcomm`` exports, under its lower-cased class name (``onebit``, ``quantize``,
...; ``none`` is ``NoCompression``), with keyword arguments as ``quantize(bits=4)``.

In-process (default), the devices are ``--devices`` simulated CPU devices (or the real GPUs/TPUs)
of one process. With ``--procs N`` the bench starts ``N`` processes of one CPU device each,
wired through :func:`jaxcomm.cli.launch.launch_local` (gloo over TCP), optionally on a loopback
shaped with ``--rate``/``--delay`` (root); times are then the slowest
rank's, each run after a barrier.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "OPS",
    "BenchConfig",
    "BenchRow",
    "bus_factor",
    "compressor_registry",
    "format_rows",
    "make_compressor",
    "parse_size",
    "plot_rows",
    "register_compressor",
    "registered_compressors",
    "run_bench",
    "split_specs",
]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")

_USER_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_compressor(name: str, factory: Callable[..., Any]) -> None:
    """Makes ``factory(**kwargs)`` available to the bench as ``name`` (overrides built-ins)."""
    _USER_REGISTRY[name.lower()] = factory


def compressor_registry() -> dict[str, Callable[..., Any]]:
    """Name -> constructor of every compressor the bench can use.

    Every concrete :class:`jaxcomm.Compressor` subclass exported by ``jaxcomm`` appears under its
    lower-cased class name (so compressors added to the library appear without editing the
    bench); ``none`` aliases ``NoCompression``; :func:`register_compressor` adds more.
    """
    import inspect

    import jaxcomm as jc

    registry: dict[str, Callable[..., Any]] = {}
    for name in getattr(jc, "__all__", dir(jc)):
        obj = getattr(jc, name, None)
        if (
            inspect.isclass(obj)
            and issubclass(obj, jc.Compressor)
            and obj is not jc.Compressor
            and not inspect.isabstract(obj)
        ):
            registry[name.lower()] = obj
    if "nocompression" in registry:
        registry["none"] = registry["nocompression"]
    registry.update(_USER_REGISTRY)
    return registry


_SPEC = re.compile(r"^\s*(?P<name>[A-Za-z_][\w-]*)\s*(?:\((?P<args>.*)\))?\s*$")


def make_compressor(spec: str) -> Any:
    """A compressor from ``"name"`` or ``"name(key=value, ...)"`` (values are Python literals)."""
    m = _SPEC.match(spec)
    registry = compressor_registry()
    if not m or m.group("name").lower() not in registry:
        raise ValueError(
            f"jaxcomm bench: unknown compressor {spec!r}; known: {', '.join(sorted(registry))} "
            "(keyword arguments as e.g. quantize(bits=4))"
        )
    kwargs: dict[str, Any] = {}
    if m.group("args") and m.group("args").strip():
        try:
            call = ast.parse(f"f({m.group('args')})", mode="eval").body
            assert isinstance(call, ast.Call) and not call.args
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        except (SyntaxError, ValueError, AssertionError) as e:
            raise ValueError(
                f"jaxcomm bench: compressor arguments must be key=literal pairs, got {spec!r}"
            ) from e
    try:
        return registry[m.group("name").lower()](**kwargs)
    except TypeError as e:
        raise ValueError(f"jaxcomm bench: cannot build compressor {spec!r}: {e}") from e


def registered_compressors() -> list[str]:
    """Names of the registered compressors that build without arguments (``none`` first)."""
    names = []
    for name, factory in compressor_registry().items():
        if name == "nocompression":
            continue  # listed as "none"
        try:
            factory()
        except (TypeError, ValueError):
            continue
        names.append(name)
    return sorted(names, key=lambda n: (n != "none", n))


def split_specs(text: str) -> list[str]:
    """Comma-separated items; commas inside parentheses stay: ``quantize(bits=4,block_size=64)``."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20}
_UNITS |= {"MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"64K"``, ``"16M"``, ``"1G"`` (binary units, like nccl-tests)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"jaxcomm bench: cannot read size {text!r} (e.g. 4096, 64K, 16M)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"jaxcomm bench: size must be positive, got {text!r}")
    return int(value)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of ``op`` on ``n`` devices (DeepSpeed ``ds_bench``, nccl-tests)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"jaxcomm bench: unknown op {op!r}; choose from {OPS}")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
      ops: subset of :data:`OPS`.
      compressors: compressor specs (see :func:`make_compressor`).
      sizes: message sizes in bytes (see the module docstring for what ``S`` is per op).
      repeats: timed calls per row (the median is reported).
      warmup: untimed calls per row after compiling.
      bucket_bytes: passed to the collectives (``None``: one bucket).
      devices: simulated CPU devices in-process (ignored when a backend already exists).
      seed: data seed.
      no_network: also time every row on one device alone (the ``compute`` column).
    """

    ops: tuple[str, ...] = OPS
    compressors: tuple[str, ...] = ("none", "onebit")
    sizes: tuple[int, ...] = (64 << 10, 1 << 20, 16 << 20)
    repeats: int = 5
    warmup: int = 1
    bucket_bytes: int | None = None
    devices: int = 8
    seed: int = 0
    no_network: bool = False

    def validate(self) -> BenchConfig:
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise ValueError(f"jaxcomm bench: unknown op(s) {bad}; choose from {OPS}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("jaxcomm bench: repeats must be >= 1 and warmup >= 0")
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError("jaxcomm bench: sizes must be positive")
        for spec in self.compressors:
            make_compressor(spec)
        return self


class BenchRow(NamedTuple):
    """One measurement. Bandwidths in bytes/s, time in seconds; see the module docstring."""

    op: str
    compressor: str
    devices: int
    size_bytes: int
    median_s: float
    algbw: float
    busbw: float
    wire_bytes: float
    wire_bw: float
    rel_error: float
    flags: str
    compute_s: float | None = None


# --------------------------------------------------------------------------------------------
# Measuring one row (shared by the in-process and multi-process modes).
# --------------------------------------------------------------------------------------------


def _elements(op: str, size_bytes: int, n: int) -> tuple[int, int]:
    """(elements E of the size S, elements L of one device's input block)."""
    e = max(n, math.ceil(size_bytes / 4 / n) * n)  # a multiple of n
    return e, (e // n if op == "all_gather" else e)


def _reference(op: str, data, n: int):
    """The exact global output for per-device input rows ``data`` of shape ``(n, L)``."""
    import numpy as np

    if op in ("all_reduce", "reduce_scatter"):
        return data.astype(np.float64).mean(0)
    if op == "all_gather":
        return data.reshape(-1)
    c = data.shape[1] // n  # all_to_all: device d gets row d of every device's (n, c) block
    return data.reshape(n, n, c).transpose(1, 0, 2).reshape(-1)


def _build(op: str, comp, mesh, n: int, e: int, bucket_bytes: int | None):
    """(jitted fn, local state or None) for ``op``; ``fn(x, state) -> (state, out)``, the state
    donated. The state is returned first: JAX pairs each output with a donated input of its
    shape in order, and a mean returned first took the worker residual's buffer, so that XLA
    copied the residual for the non-finite guard's read of it (a 64 MiB copy in a OneBit op).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    dp = P("dp")
    local = jax.ShapeDtypeStruct((e,), jnp.float32)
    if op == "all_reduce":
        state = jc.init_state(comp, local, axis_size=n, bucket_bytes=bucket_bytes)

        def body(x, s):
            out, s = jc.compressed_pmean(
                x, s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes
            )
            return s, out

        specs = ((dp, dp), (dp, P()))
    elif op == "reduce_scatter":
        state = jc.init_state(
            comp, local, axis_size=n, bucket_bytes=bucket_bytes, op="reduce_scatter"
        )

        def body(x, s):
            out, s = jc.compressed_pmean_scatter(
                x, s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes
            )
            return s, out

        specs = ((dp, dp), (dp, dp))
    elif op == "all_gather":
        state = None

        def body(x, s):
            out, _ = jc.compressed_all_gather(
                x, None, axis_name="dp", compressor=comp, like=local, bucket_bytes=bucket_bytes
            )
            return s, out

        specs = ((dp, dp), (dp, P()))
    else:
        state = None

        def body(x, s):
            out = lax.all_to_all(x.reshape(n, -1), "dp", 0, 0, tiled=True)
            return s, out.reshape(-1)

        specs = ((dp, dp), (dp, dp))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=specs[0], out_specs=specs[1], check_vma=True),
        donate_argnums=(1,),  # as a train step donates its error feedback
    )
    return fn, state


def _rel_error(out, ref) -> float:
    """Relative L2 error over this process's addressable shards of ``out``."""
    import numpy as np

    num = den = 0.0
    seen = set()
    for shard in out.addressable_shards:
        key = str(shard.index)
        if key in seen:  # replicated outputs: every device holds the same data
            continue
        seen.add(key)
        got = np.asarray(shard.data, np.float64)
        want = np.asarray(ref[shard.index], np.float64)
        num += float(np.sum((got - want) ** 2))
        den += float(np.sum(want**2))
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def _measure_rows(config: BenchConfig, mesh, to_global, barrier) -> list[dict]:
    """Per-row results with raw per-repeat times (this process's view)."""
    import jax
    import numpy as np

    from jaxcomm.inspect import report_from_hlo, requested_collectives

    n = mesh.devices.size
    results = []
    for op in config.ops:
        for spec in config.compressors:
            comp = make_compressor(spec)
            if op == "all_to_all" and type(comp).__name__ != "NoCompression":
                continue  # no compressed all-to-all exists: measured once, exactly
            for size in config.sizes:
                e, block = _elements(op, size, n)
                rng = np.random.default_rng([config.seed, size])
                data = rng.standard_normal((n, block), dtype=np.float32)
                fn, state = _build(op, comp, mesh, n, e, config.bucket_bytes)
                x = to_global(data)
                s = to_global(np.zeros((n, 1), np.float32))
                if state is not None:
                    s = jax.tree.map(lambda a: to_global(np.stack([np.asarray(a)] * n)), state)
                report = report_from_hlo(
                    fn.lower(x, s).compile().as_text(),
                    requested_collectives(jax.make_jaxpr(fn)(x, s)),
                )
                s, out = fn(x, s)
                err = _rel_error(out, _reference(op, data, n))
                times, s = _timed(fn, x, s, config, barrier)
                compute = None
                if config.no_network:
                    compute = _compute_times(op, comp, n, e, data, config)
                results.append(
                    dict(
                        op=op,
                        compressor=spec,
                        devices=n,
                        size_bytes=4 * e,
                        times=times,
                        wire_bytes=report.wire_bytes,
                        rel_error=err,
                        flags="; ".join(f"{r.op} {r.dtype}: {r.flag}" for r in report.flagged),
                        compute_times=compute,
                    )
                )
    return results


def _timed(fn, x, s, config: BenchConfig, barrier) -> tuple[list[float], object]:
    """Per-repeat times of ``fn(x, s)`` after the warm-up, the state donated and carried."""
    import jax

    for _ in range(config.warmup):
        barrier()
        s, _ = jax.block_until_ready(fn(x, s))
    times = []
    for _ in range(config.repeats):
        barrier()
        t0 = time.perf_counter()
        s, _ = jax.block_until_ready(fn(x, s))
        times.append(time.perf_counter() - t0)
    return times, s


def _compute_times(op: str, comp, n: int, e: int, data, config: BenchConfig) -> list[float]:
    """The row's op on this process's first device alone: compression, no link (``compute``).

    The device's own input block (``e`` elements, as on ``n`` devices) over an axis of size 1.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType

    mesh = jax.sharding.Mesh(
        np.array(jax.local_devices()[:1]), ("dp",), axis_types=(AxisType.Auto,)
    )
    e1 = e // n if op == "all_gather" else e
    fn, state = _build(op, comp, mesh, 1, e1, config.bucket_bytes)
    device = jax.local_devices()[0]
    x = jax.device_put(np.asarray(data[0][:e1]), device)
    if state is None:
        s = jax.device_put(np.zeros((1,), np.float32), device)
    else:
        s = jax.tree.map(lambda a: jax.device_put(np.asarray(a), device), state)
    s, _ = fn(x, s)
    times, _ = _timed(fn, x, s, config, lambda: None)
    return times


def _rows(results: Sequence[dict]) -> list[BenchRow]:
    rows = []
    for r in results:
        t = statistics.median(r["times"])
        algbw = r["size_bytes"] / t
        rows.append(
            BenchRow(
                op=r["op"],
                compressor=r["compressor"],
                devices=r["devices"],
                size_bytes=r["size_bytes"],
                median_s=t,
                algbw=algbw,
                busbw=algbw * bus_factor(r["op"], r["devices"]),
                wire_bytes=r["wire_bytes"],
                wire_bw=r["wire_bytes"] / t,
                rel_error=r["rel_error"],
                flags=r["flags"],
                compute_s=(
                    statistics.median(r["compute_times"]) if r.get("compute_times") else None
                ),
            )
        )
    return rows


# --------------------------------------------------------------------------------------------
# In-process.
# --------------------------------------------------------------------------------------------


def _in_process(config: BenchConfig) -> list[BenchRow]:
    import jax

    from jaxcomm.runtime import backends_initialized, configure_host_allocator

    # Simulated devices must be requested before jax initializes its CPU backend, and the
    # host allocator set as the multi-process workers' init_distributed sets it.
    if not backends_initialized():
        configure_host_allocator()
        if "JAX_NUM_CPU_DEVICES" not in os.environ:
            jax.config.update("jax_num_cpu_devices", config.devices)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    n = min(config.devices, len(devices))
    if n < 2:
        raise RuntimeError(
            f"jaxcomm bench: needs >= 2 devices, found {len(devices)} "
            "(set JAX_NUM_CPU_DEVICES before jax starts, or use --procs)"
        )
    mesh = jax.sharding.Mesh(np.array(devices[:n]), ("dp",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, P("dp"))

    def to_global(rows):
        return jax.device_put(np.asarray(rows).reshape(-1, *np.shape(rows)[2:]), sharded)

    results = _measure_rows(config, mesh, to_global, lambda: None)
    return _rows(results)


# --------------------------------------------------------------------------------------------
# Multi-process: launcher side and worker side.
# --------------------------------------------------------------------------------------------


def _worker(out_dir: str, config_json: str) -> None:
    """One rank: 1 CPU device, gloo collectives; writes its raw results to ``out_dir``."""
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm.runtime import init_distributed

    raw = json.loads(config_json)
    config = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    info = init_distributed("gloo", initialization_timeout=120)
    rank = info.process_id
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, P("dp"))

    def to_global(rows):
        local = np.asarray(rows)[rank]  # every rank builds all rows (for the reference)
        return jax.make_array_from_process_local_data(sharded, local.reshape(-1))

    token = to_global(np.ones((mesh.devices.size, 1), np.float32))
    sync = jax.jit(
        jax.shard_map(lambda t: lax.psum(t, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    )

    def barrier():
        sync(token).block_until_ready()

    results = _measure_rows(config, mesh, to_global, barrier)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    barrier()
    jax.distributed.shutdown()


def _multi_process(
    config: BenchConfig,
    procs: int,
    rate: str | None,
    delay: str | None,
    timeout: float,
    echo: bool,
) -> list[BenchRow]:
    from jaxcomm.cli.launch import LaunchError, delay_options, launch_local

    if procs < 2:
        raise ValueError("jaxcomm bench: --procs must be >= 2")
    shaping, _ = delay_options(delay, rate)
    with tempfile.TemporaryDirectory(prefix="jaxcomm-bench-") as out:
        worker = ["-m", "jaxcomm.cli.bench", "--worker", out, json.dumps(asdict(config))]
        argv = [sys.executable, *worker]
        xla_flags = " ".join(
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        )
        result = launch_local(
            procs,
            argv,
            env={"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags},
            timeout=timeout,
            echo=echo,
            **shaping,
        )
        if not result.ok:
            raise LaunchError(result)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(procs)]
    merged = []
    for rows in zip(*ranks, strict=True):
        # A collective is done when its slowest participant is.
        times = [max(r["times"][i] for r in rows) for i in range(config.repeats)]
        err = math.sqrt(statistics.fmean(r["rel_error"] ** 2 for r in rows))
        compute = None
        if rows[0].get("compute_times"):  # no link in between: the slower rank's compute
            compute = [max(r["compute_times"][i] for r in rows) for i in range(config.repeats)]
        merged.append({**rows[0], "times": times, "rel_error": err, "compute_times": compute})
    return _rows(merged)


def run_bench(
    config: BenchConfig,
    *,
    procs: int | None = None,
    rate: str | None = None,
    delay: str | None = None,
    timeout: float = 900.0,
    echo: bool = False,
) -> list[BenchRow]:
    """Measures every (op, compressor, size) of ``config``; see the module docstring."""
    config.validate()
    if procs:
        return _multi_process(config, procs, rate, delay, timeout, echo)
    if rate or delay:
        raise ValueError("jaxcomm bench: --rate/--delay shape a network: they need --procs")
    return _in_process(config)


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------


def _human_bytes(b: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if b >= scale:
            return f"{b / scale:.4g}{unit}"
    return f"{b:.0f}"


def _gbps(bw: float) -> str:
    return f"{bw / 1e9:.3g}"


_COLUMNS = (
    "op",
    "compressor",
    "size",
    "time (ms)",
    "compute (ms)",
    "algbw GB/s",
    "busbw GB/s",
    "wire/dev",
    "wire GB/s",
    "error",
    "flags",
)


def _cells(r: BenchRow) -> tuple[str, ...]:
    return (
        r.op,
        r.compressor,
        _human_bytes(r.size_bytes),
        f"{r.median_s * 1e3:.3f}",
        "-" if r.compute_s is None else f"{r.compute_s * 1e3:.3f}",
        _gbps(r.algbw),
        _gbps(r.busbw),
        _human_bytes(r.wire_bytes),
        _gbps(r.wire_bw),
        f"{r.rel_error:.2g}",
        r.flags or "",
    )


_COMPUTE = _COLUMNS.index("compute (ms)")


def _shown(rows: Sequence[BenchRow], columns=_COLUMNS) -> list[int]:
    """Column indices to show: ``compute`` only when measured (``--no-network``)."""
    measured = any(r.compute_s is not None for r in rows)
    return [i for i in range(len(columns)) if measured or i != _COMPUTE]


def format_rows(rows: Sequence[BenchRow]) -> str:
    """Plain-text table of ``rows``."""
    keep = _shown(rows)
    cells = [[row[i] for i in keep] for row in [_COLUMNS] + [_cells(r) for r in rows]]
    left = {0, 1, len(keep) - 1}  # op, compressor, flags
    widths = [max(len(c[i]) for c in cells) for i in range(len(keep))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    )


def print_rows(rows: Sequence[BenchRow], title: str, *, plain: bool = False) -> None:
    """A rich table on a terminal-capable stdout (plain text without ``rich`` or with plain)."""
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(format_rows(rows))
        return
    from rich import box

    show_flags = any(r.flags for r in rows)
    keep = [i for i in _shown(rows) if show_flags or i != len(_COLUMNS) - 1]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i in keep:
        flags = i == len(_COLUMNS) - 1
        table.add_column(
            _COLUMNS[i], justify="left" if i < 2 or flags else "right", no_wrap=not flags
        )
    for r in rows:
        cells = _cells(r)
        table.add_row(*(cells[i] for i in keep), style="red" if r.flags else None)
    console = Console()
    if not console.is_terminal:  # pipes and logs: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)


def size_label(nbytes: float) -> str:
    """Tick label of a message size: ``64K``, ``1M``, ``16M`` (binary units, as ``--sizes``)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def _minor_gbps_label(y: float, _pos=None) -> str:
    """Label the 2x and 5x minor ticks of a log axis (a decade often holds every point)."""
    if y <= 0:
        return ""
    lead = y / 10 ** math.floor(math.log10(y))
    return f"{y:g}" if round(lead, 6) in (2.0, 5.0) else ""


def plot_title(op: str, where: str | None) -> str:
    """A panel's title: the op and where it ran (``in-process, no network`` by default)."""
    return f"{op}\n{where or 'in-process, no network'}"


def plot_rows(rows: Sequence[BenchRow], path: str, where: str | None = None) -> dict[str, list]:
    """Effective bandwidth (algbw) against size, one line per compressor, one panel per op.

    ``where`` says how the ranks were connected (e.g. ``2 processes (gloo), 1gbit``); without
    it the titles say the run was in one process, with no network in between. Returns what
    the figure shows: ``{"titles": [...], "xticks": [[...], ...]}``, one entry per panel.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "jaxcomm bench --plot needs matplotlib: pip install 'jaxcomm[examples]' "
            "(or pip install matplotlib)"
        ) from e
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ops = [op for op in OPS if any(r.op == op for r in rows)]
    sizes = sorted({r.size_bytes for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(max(6.0, 4.8 * len(ops)), 4.0), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for comp in dict.fromkeys(r.compressor for r in rows if r.op == op):
            pts = sorted(
                (r.size_bytes, r.algbw) for r in rows if r.op == op and r.compressor == comp
            )
            ax.plot([p[0] for p in pts], [p[1] / 1e9 for p in pts], marker="o", label=comp)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # Ticks at the measured sizes, labelled as --sizes writes them (64K, 1M), and plain
        # GB/s numbers instead of 6e-1.
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(x)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_gbps_label))
        ax.set_title(plot_title(op, where), fontsize="medium")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("effective bandwidth algbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    drawn = {
        "titles": [ax.get_title() for ax in axes[0]],
        "xticks": [[t.get_text() for t in ax.get_xticklabels()] for ax in axes[0]],
    }
    plt.close(fig)
    return drawn


def rows_to_json(rows: Sequence[BenchRow], config: BenchConfig, **meta: Any) -> dict:
    """JSON-ready dict of a run."""
    return {"config": asdict(config), **meta, "rows": [r._asdict() for r in rows]}


if __name__ == "__main__":  # worker entry of the multi-process mode
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: use `jaxcomm bench`; this entry is the multi-process worker")
