"""Local multi-process launcher (torchrun-style) for tests, benchmarks and, later, the CLI.

:func:`launch_local` starts ``num_processes`` copies of a command on this machine with the
environment :func:`jaxcomm.init_distributed` reads (``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), captures each
rank's output, and tears everything down as soon as one rank fails or the timeout passes: each
rank runs in its own process group, which is killed as a whole, so nothing is left behind.

Optionally the ranks share a shaped loopback (:mod:`jaxcomm.cli.netshape`: ``tc`` rate and
delay, or a userspace delay relay), a stand-in for a slow cluster network.

Multi-node runs do not use this module: start one process per host with SLURM (``srun``),
``mpirun`` or ``torchrun`` and let :func:`jaxcomm.init_distributed` read their environment.

Example::

  from jaxcomm.cli.launch import launch_local
  result = launch_local(2, [sys.executable, "train.py"], timeout=120)
  result.check()          # raises LaunchError naming the failed rank
  print(result.output)    # "[rank 0] ..." lines, in arrival order
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from jaxcomm.cli._proc import (
    LOCALHOST,
    find_free_port,
    listening,
    pdeathsig_prefix,
    port_problem,
    pump_lines,
    stopped_pids,
    terminate,
)
from jaxcomm.cli.netshape import shaped_network

# Environment that would make children pick another coordinator than the one we assign.
_STRIP_ENV = ("JAXCOMM_COORDINATOR", "JAX_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_RANK")


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch_local`.

    Attributes:
      returncodes: Exit status per rank; negative for ranks killed by a signal (``-15``,
        ``-9``) because another rank failed or the timeout passed.
      outputs: Captured stdout+stderr per rank, without prefixes.
      output: All ranks' lines prefixed with ``[rank r]``, in the order they arrived.
      failed_rank: The first rank that exited with a non-zero status, or ``None``.
      timed_out: Whether the timeout passed before all ranks finished.
      elapsed: Wall-clock seconds from the first start to the last exit.
      port: The coordinator port that was used.
      stopped_ranks: Ranks that were stopped (``SIGSTOP``, state ``T``) when the run ended, in
        the order they stopped.
      hung: Whether the run was ended because ``failed_rank`` stayed stopped for
        ``hang_timeout`` seconds.
      distributed: Whether the ranks set up ``jax.distributed`` (``jc.init_distributed`` was
        called, or the coordinator port was seen listening); ``None`` if unknown (one rank).
    """

    returncodes: tuple[int, ...]
    outputs: tuple[str, ...]
    output: str
    failed_rank: int | None
    timed_out: bool
    elapsed: float
    port: int
    stopped_ranks: tuple[int, ...] = ()
    hung: bool = False
    distributed: bool | None = None

    @property
    def ok(self) -> bool:
        """True when every rank exited with status 0."""
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def describe(self) -> str:
        """One line: success, the failed rank and its exit code, or the timeout."""
        if self.timed_out:
            running = [r for r, rc in enumerate(self.returncodes) if rc < 0]
            return f"timed out after {self.elapsed:.1f}s (ranks killed: {running})"
        if self.failed_rank is not None and self.failed_rank in self.stopped_ranks:
            why = "hang timeout" if self.hung else "another rank failed meanwhile"
            return (
                f"rank {self.failed_rank} stopped (SIGSTOP? process state T) and did not "
                f"resume ({why}; ended after {self.elapsed:.1f}s)"
            )
        if self.failed_rank is not None:
            rc = self.returncodes[self.failed_rank]
            return f"rank {self.failed_rank} exited with code {rc} after {self.elapsed:.1f}s"
        return f"all {len(self.returncodes)} ranks succeeded in {self.elapsed:.1f}s"

    def check(self) -> LaunchResult:
        """Returns ``self`` if all ranks succeeded, else raises :class:`LaunchError`."""
        if not self.ok:
            raise LaunchError(self)
        return self


class LaunchError(RuntimeError):
    """A launched rank failed or timed out; ``.result`` holds the :class:`LaunchResult`."""

    def __init__(self, result: LaunchResult, tail_lines: int = 40):
        self.result = result
        tail = "\n".join(result.output.splitlines()[-tail_lines:])
        super().__init__(f"{result.describe()}\n--- last output ---\n{tail}")


# --------------------------------------------------------------------------------------------
# Launcher.
# --------------------------------------------------------------------------------------------


#: Read by :func:`jaxcomm.init_distributed`: its default ``heartbeat_timeout_seconds``.
HEARTBEAT_ENV = "JAXCOMM_HEARTBEAT_TIMEOUT"
#: Read by :func:`jaxcomm.init_distributed`: a file it creates, so the launcher knows it ran.
MARKER_ENV = "JAXCOMM_INIT_MARKER"


def _rank_env(base: Mapping[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(base)
    for key in _STRIP_ENV:
        env.pop(key, None)
    env.update(
        MASTER_ADDR=LOCALHOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        # Keep the coordinator on loopback instead of JAX's default of all interfaces.
        JAX_COORDINATOR_BIND_ADDRESS=f"{LOCALHOST}:{port}",
        PYTHONUNBUFFERED="1",
    )
    return env


def launch_local(
    num_processes: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    timeout: float | None = None,
    netns_rate: str | None = None,
    netns_delay: str | None = None,
    netns_burst: str = "256kb",
    relay_delay: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    echo: bool | TextIO = False,
    kill_grace: float = 2.0,
    poll_interval: float = 0.05,
    heartbeat_timeout: float | None = None,
    hang_timeout: float | None = None,
) -> LaunchResult:
    """Runs ``num_processes`` ranks of ``argv`` on this machine and waits for them.

    Each rank gets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (so :func:`jaxcomm.init_distributed`
    needs no arguments), ``PYTHONUNBUFFERED=1``, and its own process group. When a rank exits
    non-zero, or ``timeout`` passes, all other ranks' groups get SIGTERM, then SIGKILL after
    ``kill_grace`` seconds. Where ``setpriv`` exists, ranks also get SIGKILL if the launching
    thread dies.

    With ``netns_rate`` or ``netns_delay``, all ranks run inside one private network namespace
    (see :func:`shaped_network`) where only the shaped loopback exists.

    With ``relay_delay``, the ranks' TCP connections (all but the coordinator's) go through a
    userspace relay that forwards every byte ``relay_delay`` later, in both directions
    (:mod:`jaxcomm.cli._delay`): a link delay where ``netem`` is unavailable, needing no root. It
    combines with ``netns_rate`` (the relay then runs inside the namespace).

    Args:
      num_processes: Number of ranks.
      argv: Command to run for every rank, e.g. ``[sys.executable, "worker.py", out_dir]``.
      env: Extra environment on top of ``os.environ`` (the launcher's own variables win).
      port: Coordinator port; default: a free port on 127.0.0.1.
      timeout: Seconds before everything is killed; ``None`` waits forever.
      netns_rate: Loopback rate for ``tc tbf``, e.g. ``"1gbit"``.
      netns_delay: One-way loopback delay for ``tc netem``, e.g. ``"500us"``.
      netns_burst: ``tbf`` bucket size.
      relay_delay: One-way delay added by the userspace relay, e.g. ``"1ms"``.
      cwd: Working directory of the ranks.
      echo: Also write prefixed lines as they arrive: ``True`` for ``sys.stderr``, or a stream.
      kill_grace: Seconds between SIGTERM and SIGKILL when tearing down.
      poll_interval: Seconds between checks of the ranks' status.
      heartbeat_timeout: Passed to every rank's :func:`jaxcomm.init_distributed` (environment
        ``JAXCOMM_HEARTBEAT_TIMEOUT``) as ``heartbeat_timeout_seconds``: ranks whose peer
        stopped sending heartbeats (stopped, hung, or behind a silent link) abort after it.
      hang_timeout: End the run when a rank has been stopped (``SIGSTOP``, process state
        ``T``) this many seconds, naming it; ``None`` waits (the other ranks' heartbeat
        timeout still ends it). A rank that is stopped when another fails is named as the
        first failure in any case.

    Hangs. A rank that stops, or a link that goes silent, blocks the others in a collective
    (gloo has no per-collective timeout that JAX exposes); they abort when JAX's heartbeats to
    the coordinator fail for ``heartbeat_timeout`` seconds. The failed rank reported is the one
    that failed first *by time*: exit times are recorded by one waiter thread per rank, and a
    stopped rank counts as failed from the moment it was seen stopped.

    Returns:
      A :class:`LaunchResult`; call ``.check()`` to raise on failure.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1.")
    if not argv:
        raise ValueError("argv must name a command.")
    for name, value in (("heartbeat_timeout", heartbeat_timeout), ("hang_timeout", hang_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value} must be > 0 seconds.")
    echo_stream: TextIO | None = sys.stderr if echo is True else (echo or None)
    if port is not None and not (netns_rate or netns_delay):
        problem = port_problem(int(port))  # inside a namespace, the host's ports do not matter
        if problem:
            raise ValueError(problem)
    port = find_free_port() if port is None else int(port)
    base_env = {**os.environ, **(env or {})}
    if heartbeat_timeout is not None:
        base_env[HEARTBEAT_ENV] = str(max(1, round(heartbeat_timeout)))

    with contextlib.ExitStack() as stack:
        prefix: list[str] = []
        if netns_rate or netns_delay:
            prefix = stack.enter_context(shaped_network(netns_rate, netns_delay, netns_burst))
        if relay_delay:
            from jaxcomm.cli._delay import delay_relay

            relay_env = stack.enter_context(
                delay_relay(relay_delay, skip_ports=(port,), prefix=prefix)
            )
            base_env = {**base_env, **relay_env}
        markers = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxcomm-launch-"))
        return _run_ranks(
            num_processes,
            [*prefix, *argv],
            base_env,
            port,
            timeout,
            cwd,
            echo_stream,
            kill_grace,
            poll_interval,
            hang_timeout,
            markers,
            probe_port=not prefix,
        )


def _run_ranks(
    n: int,
    argv: list[str],
    base_env: Mapping[str, str],
    port: int,
    timeout: float | None,
    cwd: str | os.PathLike[str] | None,
    echo: TextIO | None,
    kill_grace: float,
    poll_interval: float,
    hang_timeout: float | None,
    markers: str,
    probe_port: bool,
) -> LaunchResult:
    lock = threading.Lock()
    merged: list[str] = []
    per_rank: list[list[str]] = [[] for _ in range(n)]
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    start = time.monotonic()
    failed_rank: int | None = None
    timed_out = hung = False
    exited_at: dict[int, float] = {}  # rank -> monotonic time its process exited
    stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped
    port_seen = False
    next_scan = start

    def waiter(rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        exited_at.setdefault(rank, time.monotonic())

    try:
        for rank in range(n):
            rank_env = _rank_env(base_env, rank, n, port)
            rank_env[MARKER_ENV] = os.path.join(markers, f"rank{rank}")
            procs.append(
                subprocess.Popen(
                    [*pdeathsig_prefix(), *argv],
                    env=rank_env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    start_new_session=True,
                )
            )
        readers = [
            threading.Thread(
                target=pump_lines,
                args=(r, p.stdout, per_rank[r], merged, lock, echo),
                daemon=True,
            )
            for r, p in enumerate(procs)
        ]
        for t in readers:
            t.start()
        waiters = [
            threading.Thread(target=waiter, args=(r, p), daemon=True) for r, p in enumerate(procs)
        ]
        for t in waiters:
            t.start()

        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            if now >= next_scan:  # a /proc scan costs a few ms: not every poll
                next_scan = now + 0.25
                stopped = stopped_pids([p.pid for p in procs])
                for r, p in enumerate(procs):
                    if p.pid in stopped and codes[r] is None:
                        stopped_since.setdefault(r, now)
                    else:
                        stopped_since.pop(r, None)
                if probe_port and not port_seen and n > 1:
                    port_seen = listening(port)
            bad = [r for r, rc in enumerate(codes) if rc not in (None, 0)]
            if bad:
                # Codes are read before we kill anything, so these ranks failed on their own;
                # the first by time (a stopped rank from when it was seen stopped) is named.
                for r in bad:
                    exited_at.setdefault(r, now)
                events = {r: exited_at[r] for r in bad}
                events.update(stopped_since)
                failed_rank = min(events, key=lambda r: (events[r], r))
                break
            if all(rc == 0 for rc in codes):
                break
            if hang_timeout is not None:
                hanging = [r for r, t in stopped_since.items() if now - t >= hang_timeout]
                if hanging:
                    failed_rank = min(hanging, key=lambda r: (stopped_since[r], r))
                    hung = True
                    break
            if timeout is not None and now - start > timeout:
                timed_out = True
                break
            time.sleep(poll_interval)
    finally:
        terminate(procs, kill_grace)
    elapsed = time.monotonic() - start
    for t in readers:
        t.join(timeout=5.0)
    with lock:
        return LaunchResult(
            returncodes=tuple(int(p.returncode) for p in procs),
            outputs=tuple("\n".join(lines) for lines in per_rank),
            output="\n".join(merged),
            failed_rank=failed_rank,
            timed_out=timed_out,
            elapsed=elapsed,
            port=port,
            stopped_ranks=tuple(sorted(stopped_since, key=lambda r: (stopped_since[r], r))),
            hung=hung,
            distributed=(
                None
                if n == 1
                else port_seen
                or any(os.path.exists(os.path.join(markers, f"rank{r}")) for r in range(n))
            ),
        )
