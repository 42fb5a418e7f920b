"""Host links: all_to_all and all_gather between processes over TCP, outside any device program.

A background sync (:mod:`jaxcomm.optim.diloco.background`) moves the compressed outer gradient
between processes on the host network, outside any XLA program, so that the device keeps
running inner steps meanwhile (an XLA runtime runs one program at a time per device, and a
collective cannot outlive its program). Only data moves here, byte for byte: every arithmetic
step stays in a device program, so the result is the one the in-program collective gives.

Positions are the devices along the reduced mesh axis, ``0 .. n-1``; each belongs to one
process. :class:`HostLinks` opens one TCP connection per pair of processes (addresses are
published in ``jax.distributed``'s key-value store) and moves, per exchange, one message per
peer. Every socket operation has a timeout, and a peer that closes its end raises at once, so a
sync whose peer died or hangs fails within bounded time with a :class:`SyncError`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import os
import queue
import socket
import struct
import sys
import threading
from collections.abc import Sequence

import numpy as np

from jaxcomm._compat import distributed_global_state

_instances = itertools.count()


class SyncError(RuntimeError):
    """A background DiLoCo sync could not exchange its data (a peer died, hung, or closed)."""


def _local_address(coordinator: str | None) -> str:
    """This host's address on the route to the coordinator (no packet is sent)."""
    if not coordinator:
        return "127.0.0.1"
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def _recv_exact(sock: socket.socket, size: int, peer: int) -> bytearray:
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, 1 << 22))
        if n == 0:
            raise SyncError(f"jaxcomm: process {peer} closed its connection during a DiLoCo sync")
        got += n
    return out


class HostLinks:
    """One TCP connection to every other process, opened on first use.

    ``timeout``: seconds any single send or receive may block before :class:`SyncError`.
    Processes create their links in the same order (the same training script), which pairs
    them through the key-value store.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self._tag = next(_instances)
        self._socks: dict[int, socket.socket] | None = None
        self.sent_bytes = 0  # payload and length prefixes sent so far, all peers together

    def _connect(self) -> dict[int, socket.socket]:
        state = distributed_global_state()
        client = None if state is None else state.client
        me, world = (0, 1) if client is None else (state.process_id, state.num_processes)
        if world == 1:
            return {}
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(world)
        listener.settimeout(self.timeout)
        host = _local_address(state.coordinator_address)
        key = f"jaxcomm/diloco_links/{self._tag}"
        client.key_value_set(f"{key}/{me}", f"{host}:{listener.getsockname()[1]}")
        socks: dict[int, socket.socket] = {}
        try:
            for peer in range(me):  # connect to the lower ranks, accept the higher ones
                addr = client.blocking_key_value_get(f"{key}/{peer}", int(self.timeout * 1000))
                host, port = addr.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                sock.sendall(struct.pack("<i", me))
                socks[peer] = sock
            for _ in range(me + 1, world):
                sock, _ = listener.accept()
                sock.settimeout(self.timeout)
                (peer,) = struct.unpack("<i", _recv_exact(sock, 4, -1))
                socks[peer] = sock
        except (OSError, TimeoutError) as err:
            raise SyncError(
                f"jaxcomm: could not connect the processes for DiLoCo's background sync within "
                f"{self.timeout:g} s ({err}); check that the processes reach each other over TCP"
            ) from err
        finally:
            listener.close()
        for sock in socks.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
        return socks

    def swap(self, messages: dict[int, bytes]) -> dict[int, bytearray]:
        """Send ``messages[peer]`` to each peer and receive theirs (length-prefixed)."""
        if self._socks is None:
            self._socks = self._connect()
        self.sent_bytes += sum(8 + len(data) for data in messages.values())
        errors: list[BaseException] = []

        def send(peer: int, data: bytes) -> None:
            try:
                sock = self._socks[peer]
                sock.sendall(struct.pack("<q", len(data)))
                sock.sendall(data)
            except (OSError, TimeoutError) as err:
                errors.append(SyncError(f"jaxcomm: sending to process {peer} failed: {err}"))

        senders = [
            threading.Thread(target=send, args=item, daemon=True) for item in messages.items()
        ]
        for thread in senders:
            thread.start()
        received = {}
        try:
            for peer in sorted(messages):
                sock = self._socks[peer]
                (size,) = struct.unpack("<q", _recv_exact(sock, 8, peer))
                received[peer] = _recv_exact(sock, size, peer)
        except TimeoutError as err:
            raise SyncError(
                f"jaxcomm: no data from a peer process within {self.timeout:g} s during a "
                "DiLoCo background sync (a process hung or died)"
            ) from err
        except OSError as err:
            raise SyncError(
                f"jaxcomm: a DiLoCo background sync lost its connection: {err}"
            ) from err
        for thread in senders:
            thread.join(self.timeout)
        if errors:
            raise errors[0]
        return received

    def close(self) -> None:
        """Close every connection; a thread blocked in a receive on one of them wakes with an
        error, and the peers' next receive fails at once (they learn of the failure)."""
        for sock in (self._socks or {}).values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._socks = None


_exit_grace: list[float] = []


def bound_exit(seconds: float) -> None:
    """After a failed sync, end this process at most ``seconds`` after Python starts exiting.

    ``jax.distributed``'s shutdown (run at exit) waits at a barrier for every process, the lost
    one included, until its heartbeat or shutdown timeout (minutes) and then aborts; a process
    whose sync failed skips what is left of it and exits with status 1.
    """
    if not _exit_grace:
        # atexit runs the latest registration first: before JAX's handler (from `import jax`).
        atexit.register(_start_exit_watchdog)
    _exit_grace[:] = [float(seconds)]


def _start_exit_watchdog() -> None:
    seconds = _exit_grace[0]

    def expire() -> None:
        sys.stderr.write(
            f"jaxcomm: exiting without jax.distributed's shutdown, which still waited for the "
            f"process lost in a DiLoCo sync after {seconds:g} s\n"
        )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _pack(parts: Sequence[np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(p).tobytes() for p in parts)


def _unpack(data: bytearray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    out, offset = [], 0
    for ref in like:
        size = ref.nbytes
        out.append(np.frombuffer(data, ref.dtype, ref.size, offset).reshape(ref.shape))
        offset += size
    return out


def all_to_all(
    links: HostLinks, rows: dict[int, list[np.ndarray]], owner: Sequence[int], me: int
) -> dict[int, list[np.ndarray]]:
    """``rows[p]``: position ``p``'s arrays, each ``(n, ...)`` (row ``q`` goes to position ``q``);
    returns, for each local position ``q``, its arrays ``(n, ...)`` stacking row ``q`` of every
    position's. ``owner[p]``: the process of position ``p``; ``me``: this process."""
    n = len(owner)
    ref = next(iter(rows.values()))
    messages = {}
    for peer in sorted(set(owner) - {me}):
        theirs = [q for q in range(n) if owner[q] == peer]
        messages[peer] = _pack([w[q] for p in sorted(rows) for q in theirs for w in rows[p]])
    received = links.swap(messages) if messages else {}
    pieces: dict[tuple[int, int], list[np.ndarray]] = {}
    for p in rows:
        for q in rows:
            pieces[p, q] = [w[q] for w in rows[p]]
    row_like = [w[0] for w in ref]
    for peer, data in received.items():
        mine = sorted(rows)
        sources = [p for p in range(n) if owner[p] == peer]
        flat = _unpack(data, row_like * (len(sources) * len(mine)))
        k = 0
        for p in sources:
            for q in mine:
                pieces[p, q] = flat[k : k + len(row_like)]
                k += len(row_like)
    return {
        q: [np.stack([pieces[p, q][i] for p in range(n)]) for i in range(len(row_like))]
        for q in rows
    }


def all_gather(
    links: HostLinks, rows: dict[int, list[np.ndarray]], owner: Sequence[int], me: int
) -> list[np.ndarray]:
    """``rows[p]``: position ``p``'s arrays; returns each array stacked over all positions."""
    n = len(owner)
    ref = next(iter(rows.values()))
    mine = _pack([w for p in sorted(rows) for w in rows[p]])
    received = links.swap({peer: mine for peer in set(owner) - {me}}) if n > len(rows) else {}
    pieces = dict(rows)
    for peer, data in received.items():
        sources = [p for p in range(n) if owner[p] == peer]
        flat = _unpack(data, list(ref) * len(sources))
        for k, p in enumerate(sources):
            pieces[p] = flat[k * len(ref) : (k + 1) * len(ref)]
    return [np.stack([pieces[p][i] for p in range(n)]) for i in range(len(ref))]


class SyncRunner:
    """One daemon thread running submitted exchanges in order, each a future. A daemon, so that
    a process ending (an error, an interrupt) does not wait for an exchange blocked on a lost
    peer."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn, *args) -> concurrent.futures.Future:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxcomm-diloco-sync")
            self._thread.daemon = True
            self._thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001 (re-raised by the merging step)
                    future.set_exception(err)

    def close(self) -> None:
        self._queue.put(None)
