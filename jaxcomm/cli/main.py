"""The ``jaxcomm`` command line.

``jaxcomm demo``     train one model data-parallel with each optimizer; quality and traffic
``jaxcomm bench``    nccl-tests / ds_bench for jaxcomm: time, algbw, busbw, wire bytes (HLO)
``jaxcomm launch``   N local processes wired for ``jax.distributed`` (torchrun-style)

Each subcommand is one ``_add_<name>`` function that registers its parser and sets ``run``;
adding a command is adding one such function to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator

from jaxcomm.cli import bench, bench_report, bench_specs
from jaxcomm.cli._text import terminal_text


def _version() -> str:
    import jax

    import jaxcomm

    return f"jaxcomm {jaxcomm.__version__} (jax {jax.__version__}, Python {sys.version.split()[0]})"


# --------------------------------------------------------------------------------------------
# jaxcomm bench
# --------------------------------------------------------------------------------------------


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time compressed collectives: algbw, busbw, bytes on the wire (HLO)",
        description=terminal_text(bench.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ops",
        default=",".join(bench_specs.OPS),
        help=f"comma-separated subset of {','.join(bench_specs.OPS)} (all)",
    )
    p.add_argument(
        "--compressors",
        default="none,onebit",
        help="comma-separated compressor specs, e.g. none,onebit,quantize(bits=4) "
        "(default: none,onebit); 'all' runs every registered compressor that needs no "
        f"arguments: {','.join(bench_specs.registered_compressors())}",
    )
    p.add_argument(
        "--sizes", default="64K,1M,16M", help="comma-separated message sizes (64K,1M,16M)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per row; median (5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per row (1)")
    p.add_argument("--bucket-bytes", type=int, default=None, help="bucket size (one bucket)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices in-process (8)")
    p.add_argument("--procs", type=int, default=None, help="run on N processes (gloo) instead")
    p.add_argument("--rate", default=None, help="with --procs: shaped loopback rate, e.g. 1gbit")
    p.add_argument("--delay", default=None, help="with --procs: loopback one-way delay, e.g. 1ms")
    p.add_argument("--timeout", type=float, default=900.0, help="multi-process timeout (900 s)")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot algbw against size (needs matplotlib)")
    p.add_argument("--plain", action="store_true", help="plain-text table instead of rich")
    p.add_argument(
        "--no-network",
        action="store_true",
        help="also time each op on one device alone: a compute column (compression cost, no link)",
    )
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from jaxcomm.cli._paths import output_problem

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = output_problem(path)
        if problem:  # fail before measuring, not after
            print(f"jaxcomm bench: {flag}: {problem}", file=sys.stderr)
            return 2
    if args.procs is not None and args.procs < 1:  # 0 would silently run in-process
        print(f"jaxcomm bench: --procs must be >= 1, got {args.procs}", file=sys.stderr)
        return 2
    if not args.procs and args.devices < 2:  # JAX's own error for 0: a process index
        print(f"jaxcomm bench: --devices must be >= 2, got {args.devices}", file=sys.stderr)
        return 2
    if args.plot:  # fail before measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "jaxcomm bench: --plot needs matplotlib: pip install 'jaxcomm[cli]' "
                "(or pip install matplotlib)",
                file=sys.stderr,
            )
            return 2
    try:
        compressors = (
            bench_specs.registered_compressors()
            if args.compressors.strip() == "all"
            else bench_specs.split_specs(args.compressors)
        )
        config = bench_specs.BenchConfig(
            ops=tuple(bench_specs.split_specs(args.ops)),
            compressors=tuple(compressors),
            sizes=tuple(bench_specs.parse_size(s) for s in bench_specs.split_specs(args.sizes)),
            repeats=args.repeats,
            warmup=args.warmup,
            bucket_bytes=args.bucket_bytes,
            devices=args.devices,
            no_network=args.no_network,
        ).validate()
        rows = bench.run_bench(
            config, procs=args.procs, rate=args.rate, delay=args.delay, timeout=args.timeout
        )
    except (ValueError, RuntimeError) as e:
        print(f"jaxcomm bench: {e}" if not str(e).startswith("jaxcomm") else e, file=sys.stderr)
        return 2
    n = rows[0].devices if rows else 0
    if args.procs:
        from jaxcomm.cli.netshape import delay_options

        where = f"{args.procs} processes (gloo), {delay_options(args.delay, args.rate)[1]}"
    else:
        where = f"{n} devices in one process"
    title = (
        f"jaxcomm bench: {where}; median of {config.repeats}; algbw = S/t (effective), "
        "busbw per ds_bench, wire = bytes per device from HLO; state donated and carried "
        "from call to call, as in a train step"
    )
    bench_report.print_rows(rows, title, plain=args.plain)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                bench_report.rows_to_json(
                    rows, config, procs=args.procs, rate=args.rate, delay=args.delay
                ),
                f,
                indent=2,
            )
    if args.plot:
        if not args.procs:
            import jax

            platform = jax.devices()[0].platform
            where = (
                f"in-process, {n} CPU devices, no network"
                if platform == "cpu"
                else f"in-process, {n} {platform.upper()} devices"
            )
        bench_report.plot_rows(rows, args.plot, where=where)
        print(f"wrote {args.plot}")
    return 0


# --------------------------------------------------------------------------------------------
# jaxcomm launch
# --------------------------------------------------------------------------------------------

_LAUNCH_EPILOG = """\
Every rank gets MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE, so `jc.init_distributed()` needs no arguments. Output lines
are prefixed with "[rank r]". If a rank exits non-zero, the others are stopped (SIGTERM, then
SIGKILL) and the launcher exits with that rank's code, naming it; Ctrl-C stops all ranks.
The rank named is the first to fail by time. Hangs: with --heartbeat-timeout S, ranks whose
peer stopped (SIGSTOP) or whose link went silent abort after about S to 2S seconds (JAX's
heartbeats; gloo has no collective timeout), and a rank seen stopped is named as the cause;
--hang-timeout S also ends a run whose rank stays stopped S seconds, without JAX's help.

--rate (root) runs all ranks in one private network namespace whose loopback is shaped by
tc tbf. --delay uses tc netem there when the kernel has it; otherwise (containers, gVisor)
the ranks' TCP connections go through a userspace relay that delivers every byte that much
later in each direction (needs a C compiler once for its connect() shim; no root).

Multi-node: do not use this launcher; start one process per host with your scheduler and let
jc.init_distributed() read its environment: torchrun/DeepSpeed (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), `srun` under SLURM (JAX's own detection from SLURM_PROCID, SLURM_NTASKS,
SLURM_STEP_NODELIST), or `mpirun` (OMPI_COMM_WORLD_RANK/SIZE; coordinator from
JAXCOMM_COORDINATOR=host:port or MASTER_ADDR/MASTER_PORT).
"""


def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run N local processes wired for jax.distributed",
        description="Start N local ranks of a script, torchrun-style.",
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    p.add_argument("--rate", default=None, help="shape the loopback to this tc rate (root)")
    p.add_argument(
        "--delay",
        default=None,
        help="one-way delay between ranks, e.g. 1ms: tc netem (root), else a userspace relay",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (a free one)")
    p.add_argument("--timeout", type=float, default=None, help="kill all ranks after T seconds")
    p.add_argument("--kill-grace", type=float, default=2.0, help="SIGTERM-to-SIGKILL seconds")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="seconds without heartbeats before ranks abort (jc.init_distributed; JAX: 100)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="end the run when a rank stays stopped (SIGSTOP) this many seconds",
    )
    p.add_argument("-m", dest="module", default=None, help="run a module (python -m) instead")
    p.add_argument("script", nargs="?", help="script.py (run with this Python) or a program")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for every rank")
    p.set_defaults(run=_run_launch)


def _rank_argv(args: argparse.Namespace) -> list[str]:
    if args.module:
        rest = ([args.script] if args.script else []) + list(args.args)
        return [sys.executable, "-m", args.module, *rest]
    if not args.script:
        raise ValueError("name a script (script.py ARGS) or a module (-m module ARGS)")
    if args.script.endswith(".py"):
        return [sys.executable, args.script, *args.args]
    return [args.script, *args.args]


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP to the launcher unwind through launch_local's teardown, like Ctrl-C."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run_launch(args: argparse.Namespace) -> int:
    from jaxcomm.cli.launch import launch_local
    from jaxcomm.cli.netshape import delay_options

    try:
        argv = _rank_argv(args)
        if args.nprocs < 1:
            raise ValueError(f"-n must be >= 1, got {args.nprocs}")
        shaping, label = delay_options(args.delay, args.rate)
    except (ValueError, RuntimeError) as e:
        print(f"jaxcomm launch: {e}", file=sys.stderr)
        return 2
    if args.rate or args.delay:
        print(f"jaxcomm launch: {args.nprocs} ranks, {label}", file=sys.stderr)
    try:
        with _sigterm_as_interrupt():
            result = launch_local(
                args.nprocs,
                argv,
                port=args.port,
                timeout=args.timeout,
                echo=sys.stdout,
                kill_grace=args.kill_grace,
                heartbeat_timeout=args.heartbeat_timeout,
                hang_timeout=args.hang_timeout,
                **shaping,
            )
    except KeyboardInterrupt:
        print("jaxcomm launch: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as e:  # busy port, namespace set-up, exec
        print(f"jaxcomm launch: {e}", file=sys.stderr)
        return 2
    if result.distributed is False:
        print(
            f"jaxcomm launch: warning: no rank called jc.init_distributed() (or "
            f"jax.distributed.initialize): the {args.nprocs} ranks ran as {args.nprocs} "
            "independent copies, not one distributed job",
            file=sys.stderr,
        )
    if result.ok:
        return 0
    print(f"jaxcomm launch: {result.describe()}; other ranks stopped", file=sys.stderr)
    if result.timed_out:
        return 124
    code = result.returncodes[result.failed_rank]
    return code if 0 < code < 256 else 1


# --------------------------------------------------------------------------------------------


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a transformer LM data-parallel with each compressed optimizer and compare",
        description="Train a byte-level transformer LM (all 256 byte values, on Python "
        "standard-library source) data-parallel on simulated CPU devices with each optimizer "
        "of --methods (exact Adam is the baseline); print held-out loss, accuracy and bytes on "
        "the wire (from the compiled HLO), say which runs diverged and why, and plot held-out "
        "loss against steps and bytes. The plot needs the 'cli' extra (pip install "
        "'jaxcomm[cli]').",
    )

    def run(args):
        from jaxcomm.cli import demo_run  # the plot needs matplotlib (the `examples` extra)
        from jaxcomm.runtime import backends_initialized, configure_host_allocator

        if not backends_initialized():  # XLA:CPU steps without page faults (see there)
            configure_host_allocator()
        return demo_run.main_from_args(args)

    from jaxcomm.cli.demo_run import add_arguments

    add_arguments(p)
    p.set_defaults(run=run)


_COMMANDS: tuple[Callable, ...] = (_add_bench, _add_launch, _add_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxcomm",
        description="jaxcomm: compressed collectives for data-parallel JAX. Commands: demo "
        "(compare the optimizers on a small model), bench (time the collectives), launch (N "
        "local processes). 'jaxcomm COMMAND --help' for each.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
