"""A shaped loopback for the launcher: all ranks in one private network namespace whose
loopback ``tc`` shapes (token bucket rate, optional ``netem`` delay), one machine standing in for
a slow cluster network.

That needs root, ``unshare``, ``nsenter``, ``ip`` and ``tc``; :func:`can_shape_network` says
whether it works here. Where the kernel lacks ``netem`` (containers, gVisor), the launcher's
``relay_delay`` adds a link delay without root: the ranks' TCP connections go through a
userspace relay that delivers every byte that much later (:mod:`jaxcomm.cli._delay`);
:func:`delay_options` picks netem when it works, else the relay.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator

from jaxcomm.cli._proc import helper_process


def _tc_script(rate: str | None, delay: str | None, burst: str) -> str:
    """Shell commands that bring up ``lo`` and shape it inside a fresh namespace."""
    cmds = ["ip link set lo up"]
    # Each packet crosses lo's egress once, so a delay d adds d one way, 2d per round trip.
    if delay and rate:
        cmds.append(f"tc qdisc add dev lo root handle 1: netem delay {shlex.quote(delay)}")
        cmds.append(
            f"tc qdisc add dev lo parent 1:1 handle 10: tbf rate {shlex.quote(rate)} "
            f"burst {shlex.quote(burst)} latency 200ms"
        )
    elif delay:
        cmds.append(f"tc qdisc add dev lo root netem delay {shlex.quote(delay)}")
    elif rate:
        cmds.append(
            f"tc qdisc add dev lo root tbf rate {shlex.quote(rate)} "
            f"burst {shlex.quote(burst)} latency 200ms"
        )
    return " && ".join(cmds)


_NETNS_TOOLS = ("unshare", "nsenter", "ip", "tc")


def _netns_prerequisites() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network shaping needs Linux network namespaces"
    if os.geteuid() != 0:
        return "network shaping needs root (unshare -n, tc)"
    missing = [t for t in _NETNS_TOOLS if shutil.which(t) is None]
    if missing:
        return f"network shaping needs {', '.join(missing)} on PATH"
    return None


@functools.cache
def network_shaping_problem(
    rate: str | None = "1gbit", delay: str | None = None, burst: str = "256kb"
) -> str | None:
    """Why a shaped namespace cannot be made here, or ``None`` if it can.

    Checks root and the tools, then really creates a throwaway namespace and applies the
    ``tc`` setup (kernels without ``sch_netem``/``sch_tbf`` fail only at that point).
    """
    problem = _netns_prerequisites()
    if problem:
        return problem
    script = _tc_script(rate, delay, burst)
    try:
        proc = subprocess.run(
            ["unshare", "-n", "-u", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -n failed: {e}"
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        return f"`unshare -n -u sh -c {script!r}` failed: {err[-1] if err else proc.returncode}"
    return None


def can_shape_network(
    rate: str | None = "1gbit", delay: str | None = None, burst: str = "256kb"
) -> bool:
    """Whether :func:`launch_local` can run ranks on a loopback shaped to ``rate``/``delay``."""
    return network_shaping_problem(rate, delay, burst) is None


@contextlib.contextmanager
def shaped_network(
    rate: str | None = "1gbit",
    delay: str | None = None,
    burst: str = "256kb",
    *,
    startup_timeout: float = 20.0,
) -> Iterator[list[str]]:
    """A private network + UTS namespace whose loopback is shaped; yields an ``nsenter`` prefix.

    A holder process (``unshare -n -u`` then ``sleep``) owns the namespace for the duration of
    the ``with`` block; prepend the yielded argv prefix to run a command inside it. The
    hostname inside is ``localhost`` so that libraries which bind to "my hostname's address"
    (gloo's TCP transport does) stay on loopback. Only ``lo`` exists inside.

    Args:
      rate: ``tc`` rate, e.g. ``"1gbit"``; ``None`` for no rate limit.
      delay: ``netem`` one-way delay, e.g. ``"1ms"``; ``None`` for none.
      burst: Token bucket size for ``tbf``.
      startup_timeout: Seconds to wait for the namespace to be ready.

    Raises:
      RuntimeError: The namespace or the ``tc`` setup could not be created.
    """
    problem = _netns_prerequisites()
    if problem:
        raise RuntimeError(problem)
    tc_setup = _tc_script(rate, delay, burst)
    script = f"hostname localhost && {tc_setup} && echo ready && exec sleep infinity"
    with helper_process(
        ["unshare", "-n", "-u", "sh", "-c", script],
        ready=lambda line: line == "ready",
        error=lambda err: RuntimeError(f"could not create shaped namespace ({script!r}): {err}"),
        startup_timeout=startup_timeout,
        capture_stderr=True,
    ) as (holder, _):
        pid = holder.pid  # setpriv, unshare and sh exec in turn: the namespace's pid
        yield ["nsenter", f"--net=/proc/{pid}/ns/net", f"--uts=/proc/{pid}/ns/uts", "--"]


def delay_options(delay: str | None, rate: str | None = None) -> tuple[dict[str, str | None], str]:
    """:func:`launch_local` keyword arguments for a link ``delay`` (and ``rate``), and a label.

    ``tc netem`` where it works (root, ``sch_netem``), else the userspace relay of
    :mod:`jaxcomm.cli._delay`. A ``rate`` always needs ``tc tbf`` (root).

    Raises:
      RuntimeError: neither way works here, or the rate cannot be shaped.
    """
    opts: dict[str, str | None] = {"netns_rate": rate, "netns_delay": None, "relay_delay": None}
    if rate and network_shaping_problem(rate):
        raise RuntimeError(f"cannot shape the rate: {network_shaping_problem(rate)}")
    labels = [f"rate {rate} (tc tbf)"] if rate else []
    if delay:
        netem = network_shaping_problem(rate, delay)
        if netem is None:
            opts["netns_delay"] = delay
            labels.append(f"delay {delay} one way (tc netem)")
        else:
            from jaxcomm.cli._delay import parse_delay, shim_problem

            parse_delay(delay)  # a clear ValueError for a bad value
            relay = shim_problem()
            if relay:
                raise RuntimeError(f"cannot add a delay: netem: {netem}; relay: {relay}")
            opts["relay_delay"] = delay
            labels.append(f"delay {delay} one way (userspace TCP relay; netem unavailable)")
    return opts, ", ".join(labels) or "unshaped loopback"
