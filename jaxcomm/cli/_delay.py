"""Link delay without ``netem``: a userspace relay on the ranks' TCP connections.

Where the kernel has no ``sch_netem`` (gVisor, some containers), :func:`delay_relay` emulates a
one-way link delay ``d`` for TCP: a small ``LD_PRELOAD`` shim interposes ``connect()`` in the
ranks, so that every IPv4 stream connection (except to the ports in ``skip_ports``, e.g. the
``jax.distributed`` coordinator) goes to a relay process instead, which opens the real connection
and forwards each chunk of bytes ``d`` seconds after it arrived, in both directions. A message
therefore reaches its peer ``d`` after it was sent and a round trip takes ``2 d``, as with
``tc qdisc add dev lo root netem delay d``.

What it does not emulate: TCP's own behaviour over a long link (the relay's sockets see no
delay, so windows and ACK clocking are those of loopback), and per-packet timing (chunks are
what one ``recv`` returns). Both matter for bulk throughput, not for the small, latency-bound
messages this is for. The relay adds its own forwarding cost (tens of microseconds per hop).

Needs Linux, a C compiler (``cc``) to build the shim once, and dynamically linked ``connect``
(true for CPython, jaxlib's gloo and gRPC).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from jaxcomm.cli._proc import helper_process

_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);
static connect_fn real_connect;
static int relay_port = -1;
static int skip[32];
static int n_skip;

static void setup(void) {
  real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
  const char *p = getenv("JAXCOMM_DELAY_RELAY_PORT");
  relay_port = p ? atoi(p) : 0;
  const char *s = getenv("JAXCOMM_DELAY_SKIP_PORTS");
  while (s && *s && n_skip < 32) {
    skip[n_skip++] = atoi(s);
    s = strchr(s, ',');
    if (s) s++;
  }
}

static int skipped(int port) {
  for (int i = 0; i < n_skip; i++)
    if (skip[i] == port) return 1;
  return 0;
}

static int io_all(int fd, unsigned char *buf, size_t n, int writing) {
  while (n) {
    ssize_t r = writing ? write(fd, buf, n) : read(fd, buf, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    buf += r;
    n -= (size_t)r;
  }
  return 0;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
  if (!real_connect) setup();
  if (relay_port <= 0 || !addr || addr->sa_family != AF_INET) return real_connect(fd, addr, len);
  const struct sockaddr_in *dst = (const struct sockaddr_in *)addr;
  int port = ntohs(dst->sin_port), type = 0;
  socklen_t tlen = sizeof type;
  if (port == relay_port || skipped(port) ||
      getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_STREAM)
    return real_connect(fd, addr, len);
  int flags = fcntl(fd, F_GETFL);
  if (flags >= 0 && (flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  struct sockaddr_in relay;
  memset(&relay, 0, sizeof relay);
  relay.sin_family = AF_INET;
  relay.sin_port = htons((unsigned short)relay_port);
  relay.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int rc = real_connect(fd, (const struct sockaddr *)&relay, sizeof relay), err = errno;
  if (rc == 0) {
    /* Header: destination IPv4 address and port, network order; the relay answers 1 byte. */
    unsigned char msg[6], ack = 0;
    memcpy(msg, &dst->sin_addr.s_addr, 4);
    memcpy(msg + 4, &dst->sin_port, 2);
    if (io_all(fd, msg, 6, 1) || io_all(fd, &ack, 1, 0) || ack != 1) {
      rc = -1;
      err = ECONNREFUSED;
    }
  }
  if (flags >= 0 && (flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags);
  if (rc != 0) {
    errno = err;
    return -1;
  }
  return 0;
}
"""


def shim_problem() -> str | None:
    """Why the relay cannot be used here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "the delay relay needs Linux (LD_PRELOAD)"
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "the delay relay needs a C compiler (cc) to build its connect() shim"
    return None


def build_shim(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Compiles the ``connect()`` shim once (cached by source hash); returns the ``.so`` path."""
    problem = shim_problem()
    if problem:
        raise RuntimeError(problem)
    digest = hashlib.sha256(_SHIM_C.encode()).hexdigest()[:16]
    base = Path(cache_dir or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    out = base / "jaxcomm" / f"delay_shim_{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "shim.c")
        src.write_text(_SHIM_C)
        tmp_out = Path(tmp, "shim.so")
        proc = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(tmp_out), str(src), "-ldl"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"could not build the delay shim: {proc.stderr.strip()}")
        shutil.move(str(tmp_out), out)  # atomic enough: same content whoever wins
    return out


# --------------------------------------------------------------------------------------------
# The relay (a separate process, so the ranks' GIL and CPU use do not stall forwarding).
# --------------------------------------------------------------------------------------------


def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
    """Forwards ``src`` -> ``dst``, each chunk ``delay`` seconds after it was received."""
    queue: deque[tuple[float, bytes]] = deque()
    cond = threading.Condition()
    done = []

    def reader() -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                with cond:
                    queue.append((time.monotonic() + delay, data))
                    cond.notify()
        except OSError:
            pass
        with cond:
            done.append(True)
            cond.notify()

    threading.Thread(target=reader, daemon=True).start()
    try:
        while True:
            with cond:
                while not queue and not done:
                    cond.wait()
                if not queue:
                    break
                due, data = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _handle(client: socket.socket, delay: float) -> None:
    try:
        header = b""
        while len(header) < 6:
            chunk = client.recv(6 - len(header))
            if not chunk:
                return
            header += chunk
        host = socket.inet_ntoa(header[:4])
        (port,) = struct.unpack("!H", header[4:])
        upstream = socket.create_connection((host, port), timeout=10)
        upstream.settimeout(None)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.sendall(b"\x01")
    a = threading.Thread(target=_pump, args=(client, upstream, delay), daemon=True)
    b = threading.Thread(target=_pump, args=(upstream, client, delay), daemon=True)
    a.start()
    b.start()
    a.join()
    b.join()
    client.close()
    upstream.close()


def serve(port: int, delay: float) -> None:
    """Runs the relay on ``127.0.0.1:port`` until killed (``port=0``: pick one, print it)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(256)
    print(server.getsockname()[1], flush=True)
    while True:
        client, _ = server.accept()
        threading.Thread(target=_handle, args=(client, delay), daemon=True).start()


_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}


def parse_delay(text: str) -> float:
    """Seconds from a ``tc``-style time with a unit: ``"1ms"``, ``"500us"``, ``"0.002s"``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read delay {text!r}: give a number and a unit (us, ms, s)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@contextlib.contextmanager
def delay_relay(
    delay: str | float,
    *,
    skip_ports: Sequence[int] = (),
    prefix: Sequence[str] = (),
    startup_timeout: float = 20.0,
) -> Iterator[dict[str, str]]:
    """Starts a relay delaying TCP by ``delay`` one way; yields the env the ranks need.

    Args:
      delay: seconds, or a ``tc``-style string (``"1ms"``, ``"500us"``).
      skip_ports: destination ports to connect to directly (the coordinator's).
      prefix: argv prefix to run the relay with (e.g. ``nsenter`` into a namespace).
      startup_timeout: seconds to wait for the relay to listen.
    """
    seconds = parse_delay(delay) if isinstance(delay, str) else float(delay)
    if not seconds >= 0:
        raise ValueError(f"delay must be >= 0, got {delay!r}")

    shim = build_shim()
    with helper_process(
        [*prefix, sys.executable, "-m", "jaxcomm.cli._delay", str(seconds)],
        ready=str.isdigit,  # the relay prints its port once it listens
        error=lambda _: RuntimeError("the delay relay did not start"),
        startup_timeout=startup_timeout,
    ) as (_, port):
        preload = " ".join(p for p in (str(shim), os.environ.get("LD_PRELOAD", "")) if p)
        yield {
            "LD_PRELOAD": preload,
            "JAXCOMM_DELAY_RELAY_PORT": port,
            "JAXCOMM_DELAY_SKIP_PORTS": ",".join(str(int(p)) for p in skip_ports),
        }


if __name__ == "__main__":  # python -m jaxcomm.cli._delay SECONDS
    serve(0, float(sys.argv[1]))
