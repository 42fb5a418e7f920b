"""The shared driver of the two-process, shaped-link benchmarks.

Each benchmark script re-runs itself with ``--worker DIR`` on two ranks (one CPU device each,
``JAX_NUM_CPU_DEVICES=1``, gloo); every rank writes ``DIR/rank{r}.json``, which this returns.
The ranks run under ``duplex.sh RATE 2`` (``--duplex``, default ``../shared/tools/duplex.sh``
beside the repository; root): each rank in its own network namespace, the two joined by a
full-duplex link whose every direction is shaped to ``--rate`` with ``tc tbf``, as two hosts on
a switch. ``--topo lo`` asks duplex.sh for its shared-queue mode instead (``DUPLEX_TOPO=lo``:
both ranks in one namespace whose loopback is shaped to ``--rate``, so both processes' bytes in
both directions pass one token bucket: half duplex, the setup of the results measured before
duplex.sh), for A/B runs. ``--rate none`` keeps the namespaces and shapes nothing;
``--no-shape`` runs both ranks under ``jaxcomm launch`` on this machine's own loopback (no root
needed; the numbers then say nothing about a slow link). :func:`report_two_ranks` records the
link (:func:`link_record`) in the results under ``"link"``.

A worker starts from either launcher's environment: duplex.sh's ``COORD``, ``NPROC`` and
``RANK``, or ``jaxcomm launch``'s ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK``
(:func:`launcher_env`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: duplex.sh's place beside the repository (``--duplex`` chooses another).
DUPLEX = REPO.parent / "shared" / "tools" / "duplex.sh"
#: duplex.sh's ``DUPLEX_TOPO`` values: auto (two ranks: a veth pair, full duplex), lo (one
#: shaped loopback shared by both ranks and both directions).
TOPOS = ("auto", "veth", "bridge", "lo")
NPROC = 2
#: Launcher variables a rank must not inherit from the caller's environment (each launcher
#: sets its own).
LAUNCHER_VARS = (
    "COORD",
    "NPROC",
    "RANK",
    "ADDR",
    "ADDRS",
    "PORT",
    "DUPLEX_NS",
    "DUPLEX_HOSTS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "JAXCOMM_COORDINATOR",
)


def add_link_options(p: argparse.ArgumentParser, rate: str = "1gbit") -> None:
    """The link options: ``--rate``, ``--topo``, ``--duplex`` and ``--no-shape``."""
    p.add_argument(
        "--rate",
        default=rate,
        help=f"tc rate of each direction of the link ({rate});\nwith --topo lo, of the one "
        "queue both directions share;\nnone: unshaped",
    )
    p.add_argument(
        "--topo",
        default="auto",
        choices=TOPOS,
        help="duplex.sh's DUPLEX_TOPO: auto (the default: each rank in its own namespace,\n"
        "a full-duplex link, RATE each way) or lo (both ranks on one shaped\n"
        "loopback, one queue for both directions: the old half-duplex setup, for A/B)",
    )
    p.add_argument(
        "--duplex",
        metavar="PATH",
        default=None,
        help="duplex.sh (../shared/tools/duplex.sh beside the repository)",
    )
    p.add_argument(
        "--no-shape",
        action="store_true",
        help="no namespaces, no shaping: jaxcomm launch on this machine's loopback\n(no root)",
    )


def two_rank_parser(
    description: str | None,
    *,
    methods: Sequence[str] = (),
    rate: str = "1gbit",
    repeats: int | None = 5,
    repeats_help: str = "timed rounds per method",
    timeout: float = 900.0,
) -> argparse.ArgumentParser:
    """A parser with the options every two-process benchmark takes: the link's (``--rate``,
    ``--topo``, ``--duplex``, ``--no-shape``: :func:`add_link_options`), ``--repeats`` (unless
    ``repeats`` is ``None``), ``--json``, ``--timeout``, the hidden ``--worker`` and, with
    ``methods``, ``--methods`` (comma-separated, all by default). Add the benchmark's own
    options to it."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    add_link_options(p, rate)
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} ({repeats})")
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


# -- the launcher's side ---------------------------------------------------------------------


def duplex_path(duplex: str | os.PathLike | None = None) -> Path:
    """duplex.sh: ``duplex`` if given, else :data:`DUPLEX`."""
    return Path(duplex).resolve() if duplex else DUPLEX


def duplex_problem(duplex: Path) -> str | None:
    """Why duplex.sh cannot run here, or ``None``."""
    if not duplex.is_file():
        return f"{duplex} not found (pass --duplex PATH)"
    if os.geteuid() != 0:
        return "duplex.sh needs root (network namespaces, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip / tc (iproute2) not installed"
    return None


def resolved_topo(topo: str) -> str:
    """duplex.sh's topology for two ranks: ``auto`` is its veth pair."""
    return "veth" if topo == "auto" else topo


def link_record(args) -> dict:
    """The link a run used, as its results record it (under ``"link"``): the launcher, the
    topology, the rate and whether each direction has its own queue."""
    if args.no_shape:
        return {
            "launcher": "jaxcomm launch (launch_local)",
            "topo": "none",
            "rate": None,
            "full_duplex": None,
            "note": "both ranks on this machine's unshaped loopback",
        }
    topo = resolved_topo(args.topo)
    duplex = duplex_path(args.duplex)
    try:
        shown = os.path.relpath(duplex, REPO)
    except ValueError:
        shown = str(duplex)
    full = topo != "lo"
    return {
        "launcher": "duplex.sh",
        "duplex": shown,
        "topo": topo,
        "rate": None if args.rate == "none" else args.rate,
        "full_duplex": full,
        "note": (
            "each rank in its own network namespace; every direction of the link shaped to "
            "the rate on its own"
            if full
            else "both ranks in one network namespace; its loopback shaped to the rate: one "
            "queue for both processes and both directions"
        ),
    }


def describe_link(record: dict) -> str:
    """One line for the output: what :func:`link_record` says."""
    if record["launcher"] != "duplex.sh":
        return f"link: {record['note']} ({record['launcher']})"
    rate = record["rate"] or "unshaped"
    each = "each direction" if record["full_duplex"] else "one queue, both directions"
    return f"link: duplex.sh topo {record['topo']}, {rate} ({each})"


def _rank_env(topo: str | None, timeout: float) -> dict[str, str]:
    """The ranks' environment: the caller's, less any launcher's variables, one CPU device each,
    this checkout importable; with ``topo``, duplex.sh's knobs too."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(
        JAX_NUM_CPU_DEVICES="1",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        XLA_FLAGS=" ".join(
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ),
    )
    if topo is not None:
        env["DUPLEX_TIMEOUT"] = str(math.ceil(timeout))
        env.pop("DUPLEX_TOPO", None)
        if topo != "auto":
            env["DUPLEX_TOPO"] = topo
    return env


def run_two_ranks(
    script: str,
    worker_args: list[str],
    *,
    rate: str,
    shaped: bool,
    timeout: float,
    prefix: str,
    topo: str = "auto",
    duplex: str | os.PathLike | None = None,
) -> list[dict] | None:
    """Both ranks' JSON results, or ``None`` (after printing SKIP) when the link cannot be
    emulated here.

    ``shaped``: under duplex.sh (``topo``: its ``DUPLEX_TOPO``; ``rate`` each way, or of the
    one queue with ``"lo"``); else under ``jaxcomm launch`` on this machine's loopback."""
    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        cmd = [sys.executable, str(Path(script).resolve()), "--worker", out, *worker_args]
        if shaped:
            path = duplex_path(duplex)
            problem = duplex_problem(path)
            if problem:
                print(
                    f"SKIP: cannot emulate the link ({problem}); rerun with --no-shape", flush=True
                )
                return None
            try:
                proc = subprocess.run(
                    ["bash", str(path), rate, str(NPROC), "--", *cmd],
                    env=_rank_env(topo, timeout),
                    cwd=str(REPO),
                    timeout=timeout + 60,
                    check=False,
                )
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"duplex.sh still running after {timeout + 60:.0f} s") from e
            if proc.returncode != 0:
                why = " (DUPLEX_TIMEOUT: --timeout reached)" if proc.returncode == 124 else ""
                raise RuntimeError(f"duplex.sh exited with status {proc.returncode}{why}")
        else:
            from jaxcomm.cli.launch import LaunchError, launch_local

            result = launch_local(
                NPROC, cmd, env=_rank_env(None, timeout), timeout=timeout, echo=True
            )
            if not result.ok:
                raise LaunchError(result)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(NPROC)]


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
    Runs :func:`run_two_ranks` with ``args.rate``, ``args.topo``, ``args.duplex``,
    ``args.no_shape`` and ``args.timeout``, prints ``table(summarize(ranks, args, shaped))``
    (``shaped``: a rate was applied) and the link, and writes the summary, with the link's
    :func:`link_record` under ``"link"``, to ``args.json`` when given. Returns the exit status
    (0, also when the link cannot be emulated: SKIP printed).
    """
    if worker_args is None:
        worker_args = sys.argv[1:]
    ranks = run_two_ranks(
        script,
        worker_args,
        rate=args.rate,
        shaped=not args.no_shape,
        timeout=args.timeout,
        prefix=prefix,
        topo=args.topo,
        duplex=args.duplex,
    )
    if ranks is None:
        return 0
    shaped = not args.no_shape and args.rate != "none"
    summary = summarize(ranks, args, shaped)
    summary["link"] = link_record(args)
    print(table(summary), flush=True)
    print(describe_link(summary["link"]), flush=True)
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


def launcher_env() -> tuple[str, int, int]:
    """``(coordinator "host:port", number of processes, rank)`` from the launcher's environment:
    duplex.sh's ``COORD``, ``NPROC``, ``RANK``, or ``jaxcomm launch``'s (torchrun's)
    ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``. Under duplex.sh it also sets
    the latter from the former, as a job script does for a tool that reads torchrun's names
    (``jc.init_distributed``, ``torch.distributed``)."""
    import os

    env = os.environ
    if "COORD" in env and "NPROC" in env:  # duplex.sh
        coord, nproc, rank = env["COORD"], int(env["NPROC"]), int(env["RANK"])
        host, _, port = coord.rpartition(":")
        env.update(MASTER_ADDR=host, MASTER_PORT=port, WORLD_SIZE=str(nproc))
        return coord, nproc, rank
    coord = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return coord, int(env["WORLD_SIZE"]), int(env["RANK"])


def start_as_user():
    """``jax.distributed.initialize`` called as a user's script calls it, with the launcher's
    coordinator, process count and rank (:func:`launcher_env`), and JAX's default mesh over the
    processes: ``(rank, n, mesh)``, axis "dp"."""
    import jax

    coord, nproc, rank = launcher_env()
    jax.distributed.initialize(coordinator_address=coord, num_processes=nproc, process_id=rank)
    n = jax.process_count()
    return jax.process_index(), n, jax.make_mesh((n,), ("dp",))


def start_gloo():
    """``jc.init_distributed("gloo")`` with one CPU device per process: ``(rank, n, mesh)``.
    It reads torchrun's variables, which :func:`launcher_env` sets under duplex.sh.

    Call it before importing JAX (the device count is read then)."""
    import os

    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    launcher_env()
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
