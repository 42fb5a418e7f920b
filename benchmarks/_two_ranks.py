"""The shared driver of the two-process, shaped-link benchmarks.

Each benchmark script re-runs itself with ``--worker DIR`` on two ranks (one CPU device each,
gloo), inside a private network namespace whose loopback is shaped to ``rate``; every rank
writes ``DIR/rank{r}.json``, which this returns.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


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
    worker_args: list[str],
    args,
    *,
    prefix: str,
    summarize: Callable,
    table: Callable,
) -> int:
    """The launcher side of a benchmark's ``main``: both ranks, then the summary.

    Runs :func:`run_two_ranks` with ``args.rate``, ``args.no_shape`` and ``args.timeout``,
    prints ``table(summarize(ranks, args, shaped))`` and writes the summary to ``args.json``
    when given. Returns the exit status (0, also when shaping is impossible: SKIP printed).
    """
    shaped = not args.no_shape
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
