"""Child-process helpers shared by the launcher and the delay relay (no jaxcomm imports)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys


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
