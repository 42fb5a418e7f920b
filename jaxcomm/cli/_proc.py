"""Child processes and ports of this machine, for the launcher and the delay relay (no jaxcomm
imports)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO


@functools.cache
def pdeathsig_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig KILL --`` where available, else nothing.

    Ranks must not outlive a launcher that is itself killed (e.g. by a CI timeout). Setting the
    parent-death signal through ``setpriv`` instead of a ``preexec_fn`` keeps the fork free of
    Python code, which matters because the launcher often runs in a multithreaded JAX process.
    """
    if not sys.platform.startswith("linux") or shutil.which("setpriv") is None:
        return ()
    try:
        ok = (
            subprocess.run(
                ["setpriv", "--pdeathsig", "KILL", "--", "true"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ("setpriv", "--pdeathsig", "KILL", "--") if ok else ()


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (it is a session leader); gone is fine."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL whatever is left after ``grace`` s."""
    for p in procs:
        if p.poll() is None:
            kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        # Also reaps grandchildren that ignored SIGTERM, even when the leader already exited.
        kill_group(p, signal.SIGKILL)
        p.wait()


@contextlib.contextmanager
def helper_process(
    argv: Sequence[str],
    *,
    ready: Callable[[str], bool],
    error: Callable[[str], Exception],
    startup_timeout: float,
    capture_stderr: bool = False,
    grace: float = 0.5,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Runs a helper (the delay relay, the namespace holder) for the ``with`` block.

    The helper is started in its own session, under :func:`pdeathsig_prefix` (it must not
    outlive a launcher that is killed outright), and says it is ready on its first stdout line:
    ``(process, that line stripped)`` is yielded once ``ready(line)`` holds. If it does not within
    ``startup_timeout`` seconds, the helper is stopped and ``error(stderr)`` is raised
    (``stderr`` is the helper's error output when ``capture_stderr``, else ``""``). On exit
    its process group is stopped (:func:`terminate`).
    """
    proc = subprocess.Popen(
        [*pdeathsig_prefix(), *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if capture_stderr else None,
        text=True,
        start_new_session=True,
    )
    try:
        got: list[str] = []
        reader = threading.Thread(
            target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""),
            daemon=True,
        )
        reader.start()
        reader.join(startup_timeout)
        if not got or not ready(got[0].strip()):
            terminate([proc], grace)
            raise error(proc.stderr.read().strip() if proc.stderr else "")
        yield proc, got[0].strip()
    finally:
        terminate([proc], grace)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def pump_lines(
    rank: int,
    stream: TextIO,
    lines: list[str],
    merged: list[str],
    lock: threading.Lock,
    echo: TextIO | None,
) -> None:
    """Copies one rank's output into ``lines`` and the prefixed ``merged`` log."""
    for line in iter(stream.readline, ""):
        text = line.rstrip("\n")
        prefixed = f"[rank {rank}] {text}"
        with lock:
            lines.append(text)
            merged.append(prefixed)
            if echo is not None:
                echo.write(prefixed + "\n")
                echo.flush()
    stream.close()


# Ports and process states of this machine.

LOCALHOST = "127.0.0.1"


def find_free_port(host: str = LOCALHOST) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_problem(port: int, host: str = LOCALHOST) -> str | None:
    """Why ``port`` cannot be the coordinator's port on ``host``, or ``None`` if it can."""
    if not 0 < port < 65536:
        return f"port {port} is not in 1..65535"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return f"port {port} on {host} is not free ({e.strerror or e}): pick another or omit it"
    return None


def listening(port: int, host: str = LOCALHOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def stopped_pids(pgids: Sequence[int]) -> set[int]:
    """Process groups among ``pgids`` with a stopped member (``/proc/*/stat`` state T or t)."""
    wanted, found = set(pgids), set[int]()
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: no detection
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces or parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) in wanted and fields[0] in ("T", "t"):
            found.add(int(fields[2]))
    return found
