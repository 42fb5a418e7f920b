"""The shared driver of the two-process, shaped-link benchmarks.

Each benchmark script re-runs itself with ``--worker DIR`` on two ranks (one CPU device each,
gloo), inside a private network namespace whose loopback is shaped to ``rate``; every rank
writes ``DIR/rank{r}.json``, which this returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def two_rank_parser(
    description: str | None,
    *,
    methods: Sequence[str] = (),
    rate: str = "1gbit",
    repeats: int | None = 5,
    repeats_help: str = "timed rounds per method",
    timeout: float = 900.0,
) -> argparse.ArgumentParser:
    """A parser with the options every two-process benchmark takes: ``--rate``, ``--repeats``
    (unless ``repeats`` is ``None``), ``--no-shape``, ``--json``, ``--timeout``, the hidden
    ``--worker`` and, with ``methods``, ``--methods`` (comma-separated, all by default). Add the
    benchmark's own options to it."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--rate", default=rate, help=f"tc rate of the shaped loopback ({rate})")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} ({repeats})")
    p.add_argument("--no-shape", action="store_true", help="run on the unshaped loopback")
    if methods:
        p.add_argument(
            "--methods", default=",".join(methods), help=f"comma-separated ({','.join(methods)})"
        )
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds before giving up")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    return p


def finish_worker(args, rank: int, result: dict, barrier: Callable | None = None) -> None:
    """A worker's last steps: its result to ``DIR/rank{rank}.json``, a barrier (both ranks
    written before either leaves) and ``jax.distributed.shutdown()``."""
    import jax

    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(result))
    if barrier is not None:
        barrier()
    jax.distributed.shutdown()


def run_two_ranks(
    script: str, worker_args: list[str], *, rate: str, shaped: bool, timeout: float, prefix: str
) -> list[dict] | None:
    """Both ranks' JSON results, or ``None`` (after printing SKIP) when shaping is impossible."""
    from jaxcomm.cli.launch import LaunchError, launch_local
    from jaxcomm.cli.netshape import network_shaping_problem

    if shaped:
        problem = network_shaping_problem(rate)
        if problem:
            print(f"SKIP: cannot shape the network ({problem}); rerun with --no-shape", flush=True)
            return None
    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        cmd = [sys.executable, str(Path(script).resolve()), "--worker", out, *worker_args]
        result = launch_local(
            2,
            cmd,
            env={"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"},
            timeout=timeout,
            netns_rate=rate if shaped else None,
            echo=True,
        )
        if not result.ok:
            raise LaunchError(result)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def report_two_ranks(
    script: str,
    worker_args: list[str] | None,
    args,
    *,
    prefix: str,
    summarize: Callable,
    table: Callable,
) -> int:
    """The launcher side of a benchmark's ``main``: both ranks, then the summary.

    Each rank runs ``script --worker DIR`` with ``worker_args``; ``None`` passes the launcher's
    own command-line arguments (the workers parse the same options).
    Runs :func:`run_two_ranks` with ``args.rate``, ``args.no_shape`` and ``args.timeout``,
    prints ``table(summarize(ranks, args, shaped))`` and writes the summary to ``args.json``
    when given. Returns the exit status (0, also when shaping is impossible: SKIP printed).
    """
    shaped = not args.no_shape
    if worker_args is None:
        worker_args = sys.argv[1:]
    ranks = run_two_ranks(
        script, worker_args, rate=args.rate, shaped=shaped, timeout=args.timeout, prefix=prefix
    )
    if ranks is None:
        return 0
    summary = summarize(ranks, args, shaped)
    print(table(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def slower_rank_medians(ranks: list[dict], key: str = "times") -> dict[str, float]:
    """Each method's median over rounds of the slower rank's time in that round.

    ``ranks[r][key][method]`` is rank ``r``'s list of per-round times (rounds aligned: every
    round starts at a barrier).
    """
    import statistics

    names = list(ranks[0][key])
    rounds = len(ranks[0][key][names[0]]) if names else 0
    return {
        name: statistics.median(max(r[key][name][i] for r in ranks) for i in range(rounds))
        for name in names
    }


def provenance(**versions: str) -> dict:
    """What a result was measured with: the command, jaxcomm's and JAX's versions (plus
    ``versions``), the machine (CPU model, cores, platform) and the date (UTC)."""
    import datetime
    import os
    import platform

    import jax

    import jaxcomm

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "jaxcomm": jaxcomm.__version__,
        "jax": jax.__version__,
        **versions,
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# -- the worker's side: start-up, model, barrier ---------------------------------------------


def start_as_user():
    """``jax.distributed.initialize`` called as a user's script calls it, from the launcher's
    environment, and JAX's default mesh over the processes: ``(rank, n, mesh)``, axis "dp"."""
    import os

    import jax

    jax.distributed.initialize(
        coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        num_processes=int(os.environ["WORLD_SIZE"]),
        process_id=int(os.environ["RANK"]),
    )
    n = jax.process_count()
    return jax.process_index(), n, jax.make_mesh((n,), ("dp",))


def start_gloo():
    """``jc.init_distributed("gloo")`` with one CPU device per process: ``(rank, n, mesh)``.

    Call it before importing JAX (the device count is read then)."""
    import os

    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    import jax
    import numpy as np

    from jaxcomm.runtime import init_distributed

    info = init_distributed("gloo", initialization_timeout=120)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    return info.process_id, info.num_processes, mesh


def mlp(width: int, layers: int, batch: int, rank: int, *, linear_last: bool = False):
    """``(params, loss_fn, local_batch)``: ``layers`` x (``width`` x ``width`` + bias) with tanh
    (``linear_last``: not after the last layer) and a mean-square loss; the same initial
    parameters on every process (seed 0), each process's own NumPy batch (seed ``1 + rank``)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        f"layer{i}": {
            "w": (rng.standard_normal((width, width), np.float32) / np.sqrt(width)).astype(
                np.float32
            ),
            "b": np.zeros((width,), np.float32),
        }
        for i in range(layers)
    }

    def loss_fn(p, batch):
        x, y = batch
        for i in range(layers):
            x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
            x = x if linear_last and i == layers - 1 else jnp.tanh(x)
        return jnp.mean((x - y) ** 2)

    data = np.random.default_rng(1 + rank)
    local = (
        data.standard_normal((batch, width), np.float32),
        data.standard_normal((batch, width), np.float32),
    )
    return params, loss_fn, local


def barrier(mesh):
    """A function that waits for a tiny psum over "dp" (both ranks start together) and returns
    the seconds it took."""
    import time

    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    split = NamedSharding(mesh, P("dp"))
    token = jax.make_array_from_process_local_data(split, np.ones((1,), np.float32))
    psum = jax.jit(
        jax.shard_map(lambda t: lax.psum(t, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    )

    def wait() -> float:
        t0 = time.perf_counter()
        psum(token).block_until_ready()
        return time.perf_counter() - t0

    return wait
