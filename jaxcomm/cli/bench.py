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

Compressors are found by name in :func:`jaxcomm.cli.bench_specs.compressor_registry`: every
:class:`jaxcomm.Compressor` subclass that ``jaxcomm`` exports, under its lower-cased class name
(``onebit``, ``quantize``, ...; ``none`` is ``NoCompression``), with keyword arguments as
``quantize(bits=4)``.

In-process (default), the devices are ``--devices`` simulated CPU devices (or the real GPUs/TPUs)
of one process. With ``--procs N`` the bench starts ``N`` processes of one CPU device each,
wired through :func:`jaxcomm.cli.launch.launch_local` (gloo over TCP), optionally on a loopback
shaped with ``--rate``/``--delay`` (root); times are then the slowest
rank's, each run after a barrier.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from jaxcomm.cli.bench_report import rows_from_results
from jaxcomm.cli.bench_specs import BenchConfig, BenchRow, make_compressor

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
    return rows_from_results(results)


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
    from jaxcomm.cli.launch import LaunchError, launch_local
    from jaxcomm.cli.netshape import delay_options

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
    return rows_from_results(merged)


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


if __name__ == "__main__":  # worker entry of the multi-process mode
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: use `jaxcomm bench`; this entry is the multi-process worker")
