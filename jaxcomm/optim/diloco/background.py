"""DiLoCo's outer sync in the background: the host side of ``jc.diloco(..., background=True)``.

Why a host side. An XLA runtime (CPU, GPU, TPU) runs one program at a time per device, in the
order they were dispatched, and a collective lives and dies inside its program: a sync's
all-reduce, however early it is issued, holds the device until the wire is done. So with
``background=True`` no step program communicates for the outer gradient: :class:`BackgroundSync`,
which ``jc.make_train_step`` attaches to the step it returns, runs each sync beside the steps:

1. before step ``t_s + 1`` it dispatches one device program without collectives that computes
   each device's pseudo-gradient ``theta_f - x_f`` from that step's input state into the state's
   ``local.pending`` slot (the steps pass it on) and runs the compressor's worker stage on it;
   a host thread moves the worker stage's wire between the processes over TCP
   (:mod:`jaxcomm.runtime.host_links`; the devices of one process exchange in memory);
2. the thread dispatches the server stage, moves its wire again, and dispatches the decoding
   (:mod:`jaxcomm.optim.diloco.programs`, the stages of :mod:`jaxcomm.compressors.staged`);
3. before step ``t_s + tau`` the step waits for the thread, puts the mean into the state's
   ``inflight`` slot and the new error feedback into ``comm``, and that step merges it exactly
   as the single-program ``overlap_steps=tau`` does: the same parameters, bit for bit.

The same design runs on every backend: device programs for the arithmetic, the host network for
the bytes (as cross-datacenter trainers do). Over a tuple of axes, slowest first
(``("host", "local")``), the exact steps over the fast axes stay in the device programs and the
host network carries only the compressed shares across the slow axis: each position of the slow
axis must then lie on one process (the mesh ``jax.make_mesh((processes, local_devices),
("host", "local"))`` does), and each process sends one message per peer and exchange, its
devices' shares together. The wire must finish within ``tau`` inner steps to
be hidden; a later one makes step ``t_s + tau`` wait for it.

Checkpoints: the state between ``t_s + 1`` and ``t_s + tau`` holds the pending pseudo-gradients
and the error feedback from before the sync, everything the sync reads; a step given a state it
did not produce (a restored checkpoint) reissues the sync from it, so a resumed run continues
bit for bit. A sync that cannot exchange (a peer process died, hung or closed its connection)
raises :class:`jaxcomm.runtime.host_links.SyncError` within ``sync_timeout`` seconds, from
the step that needs its result: never a silent wrong update.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm.axes import AxisName, split_levels
from jaxcomm.comm.state import ReduceState
from jaxcomm.compressors import Compressor, TwoStageState
from jaxcomm.optim.diloco.programs import FragmentPrograms
from jaxcomm.optim.diloco.state import (
    DiLoCoState,
    find_diloco,
    fragment_leaves,
    fragment_offsets,
)
from jaxcomm.runtime.host_links import (
    HostLinks,
    SyncError,
    SyncRunner,
    all_gather,
    all_to_all,
    bound_exit,
)

PyTree = Any


class BackgroundSpec(NamedTuple):
    """What the host side needs to know of a ``jc.diloco(..., background=True)``."""

    compressor: Compressor
    axis_name: AxisName
    bucket_bytes: int | None
    sync_every: int
    fragments: int
    overlap_steps: int
    sync_timeout: float


_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _finish_syncs() -> None:
    """At exit (before JAX's own exit handler), let the syncs in flight end (each within its
    ``sync_timeout``; at once after a failure) rather than tear JAX down under their thread."""
    for sync in list(_live):
        sync.drain()


class BackgroundUpdate:
    """The ``update`` of a ``jc.diloco(..., background=True)``: DiLoCo's update function with
    its background sync's spec, and the :class:`BackgroundSync` that drives it.

    ``jc.make_train_step`` sees it on ``tx.update``, creates the step's
    :class:`BackgroundSync` (its thread and host links) and attaches it here (``step.background``
    is that object). Traced without one (called outside that step, e.g. inside
    ``optax.chain``), it refuses: nothing would run the syncs.
    """

    def __init__(self, fn, spec: BackgroundSpec) -> None:
        self.fn, self.spec = fn, spec
        self.driver: BackgroundSync | None = None

    def __call__(self, updates, state, params=None):
        if self.driver is None:
            raise ValueError(
                "jaxcomm: diloco(background=True) runs its outer syncs from the step of "
                "jc.make_train_step (a host thread moves the outer gradient between steps); "
                "pass the transformation itself to jc.make_train_step (not inside optax.chain), "
                "or use background=False"
            )
        return self.fn(updates, state, params)


def background_update(tx) -> BackgroundUpdate | None:
    """``tx.update`` when ``tx`` is a ``jc.diloco(..., background=True)``, else ``None``."""
    update = getattr(tx, "update", None)
    return update if isinstance(update, BackgroundUpdate) else None


def issues(t: int, offset: int, sync_every: int) -> bool:
    return (t - 1) % sync_every == offset and t > 1


def _replace_diloco(opt_state, **fields):
    def swap(node):
        return node._replace(**fields) if isinstance(node, DiLoCoState) else node

    return jax.tree.map(swap, opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))


# After a failed sync, Python's exit may take this long before the process ends regardless:
# enough for the surviving processes to meet at jax.distributed's shutdown barrier.
EXIT_GRACE_S = 10.0


def take_rows(new: jax.Array, old: jax.Array, positions: set[int]) -> jax.Array:
    """``new`` with the rows (data-axis positions, axis 0) in ``positions`` taken from ``old``:
    whole shards (``new`` and ``old`` sharded alike), so nothing is copied."""
    olds = {s.device: s.data for s in old.addressable_shards}
    shards = [
        olds[s.device] if (s.index[0].start or 0) in positions else s.data
        for s in new.addressable_shards
    ]
    return jax.make_array_from_single_device_arrays(new.shape, new.sharding, shards)


class BackgroundSync:
    """Runs the outer syncs of a ``jc.diloco(..., background=True)`` beside a train step: the
    sync thread (:class:`jaxcomm.runtime.host_links.SyncRunner`) and the TCP links to the other
    processes (:class:`jaxcomm.runtime.host_links.HostLinks`) are its own.

    ``jc.make_train_step`` creates it from ``tx.update`` (a :class:`BackgroundUpdate`, to which it
    attaches itself) and exposes it as ``step.background``. Each step calls ``before(state)``
    with its input state: :meth:`perform_sync` waits for the syncs due at this step and merges
    them into the state, then :meth:`prepare_sync` issues the syncs that start at it (torchft's
    ``perform_sync`` / ``prepare_sync``); ``after(state)`` records the step's output. ``close()``
    stops the thread and closes the links.
    """

    def __init__(self, update: BackgroundUpdate, mesh, axis_name: AxisName) -> None:
        spec = update.spec
        update.driver = self
        self.spec, self.mesh = spec, mesh
        # The sync runs over its transformation's axes (``axis_name``, the step's, are alike).
        slow, fast = split_levels(spec.axis_name)
        # L: the devices of one position of the slow axis (positions s L + l of the per-device
        # arrays), whose wires travel together, one message per peer.
        self.fast_size = int(np.prod([mesh.shape[a] for a in fast], dtype=np.int64))
        self.offsets = fragment_offsets(spec.sync_every, spec.fragments)
        self._links = HostLinks(spec.sync_timeout)
        self._runner = SyncRunner()
        self._programs: dict[int, FragmentPrograms] = {}
        self._inflight: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self._last: Any = None
        self._count = 0
        self._failed = False
        _live.add(self)
        axis = list(mesh.axis_names).index(slow)
        devices = np.moveaxis(mesh.devices, axis, 0).reshape(mesh.shape[slow], -1)
        owners = [{d.process_index for d in row} for row in devices]
        if any(len(o) != 1 for o in owners):
            raise ValueError(
                f"jaxcomm: diloco(background=True) over {spec.axis_name!r} moves the outer "
                f"gradient between processes along {slow!r} only, so it needs each position of "
                f"{slow!r} on one process (its other axes within the process): build the mesh "
                f"as jax.make_mesh((processes, local devices), {('host', 'local')!r}), or use "
                "background=False"
            )
        self.owner = [next(iter(o)) for o in owners]  # the process of each slow position
        self.me = jax.process_index()
        self.split = NamedSharding(mesh, P(spec.axis_name))

    # -- the step's hooks ---------------------------------------------------------------------

    def before(self, state):
        if state is not self._last:  # a state this step did not produce: resume from it
            diloco = find_diloco(state.opt_state)
            self._count = int(np.asarray(diloco.count.addressable_data(0)))
            self._inflight.clear()
            for f, offset in enumerate(self.offsets):
                for t_i in range(self._count, self._count - self.spec.overlap_steps, -1):
                    if t_i >= 1 and issues(t_i, offset, self.spec.sync_every):
                        if t_i - 1 + self.spec.overlap_steps > self._count:
                            self._issue(state, f, t_i)
        return self.prepare_sync(self.perform_sync(state))

    def perform_sync(self, state):
        """``state`` with the syncs due at the next step (issued ``overlap_steps`` before it)
        waited for and merged: their means in ``inflight``, their error feedback in ``comm``."""
        t = self._count + 1
        for f in sorted(self._inflight):
            t_i, future = self._inflight[f]
            if t_i - 1 + self.spec.overlap_steps == t:
                del self._inflight[f]
                state = self._merge(state, f, t_i, future)
        return state

    def prepare_sync(self, state):
        """``state`` with the pseudo-gradients of the syncs that start at the next step in its
        pending slots, their reductions issued (device programs, then the thread)."""
        t = self._count + 1
        for f, offset in enumerate(self.offsets):
            if issues(t, offset, self.spec.sync_every):
                state = self._issue_new(state, f, t)
        return state

    def after(self, state) -> None:
        self._count, self._last = self._count + 1, state

    def compile_all(self, state) -> None:
        """Compiles every fragment's sync programs (:class:`FragmentPrograms`) from ``state``
        (arrays, or ``jax.ShapeDtypeStruct`` leaves with their shardings), so that no step
        waits for a compile at the first sync. ``jc.make_train_step``'s first call does it
        (with ``precompile``), as does ``step.compile_all``."""
        diloco = find_diloco(state.opt_state)
        theta, params = jax.tree.leaves(diloco.outer_params), jax.tree.leaves(state.params)
        for f, ids in enumerate(fragment_leaves(len(params), self.spec.fragments)):
            programs = self._fragment(f, diloco.local.pending[f])
            programs.compile_all([theta[i] for i in ids], [params[i] for i in ids], diloco.comm[f])

    # -- one sync -----------------------------------------------------------------------------

    def _fragment(self, f: int, pending) -> FragmentPrograms:
        if f not in self._programs:
            shapes = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in pending]
            self._programs[f] = FragmentPrograms(
                self.spec.compressor, self.spec.axis_name, self.spec.bucket_bytes, self.mesh, shapes
            )
        return self._programs[f]

    def _issue_new(self, state, f: int, t_i: int):
        """Step ``t_i = t_s + 1`` is next: compute fragment ``f``'s pseudo-gradients from its
        input state into the state's pending slot, start their reduction, and return the
        state with them (the step passes them on: a checkpoint holds them)."""
        diloco = find_diloco(state.opt_state)
        ids = fragment_leaves(len(jax.tree.leaves(state.params)), self.spec.fragments)[f]
        theta, params = jax.tree.leaves(diloco.outer_params), jax.tree.leaves(state.params)
        programs = self._fragment(f, diloco.local.pending[f])
        # Dispatched now, before the step donates the state it reads.
        pending, wires, workers, kept = programs.issue(
            [theta[i] for i in ids], [params[i] for i in ids], diloco.comm[f]
        )
        self._submit(programs, f, t_i, wires, workers, kept)
        pendings = list(diloco.local.pending)
        pendings[f] = list(pending)
        local = diloco.local._replace(pending=tuple(pendings))
        return state._replace(opt_state=_replace_diloco(state.opt_state, local=local))

    def _issue(self, state, f: int, t_i: int) -> None:
        """Resume the sync issued at step ``t_i`` from the pending slot of ``state``."""
        diloco = find_diloco(state.opt_state)
        pending, comm = diloco.local.pending[f], diloco.comm[f]
        programs = self._fragment(f, pending)
        # Dispatched now, before the next step can donate the state it reads.
        wires, workers, kept = programs.worker(pending, comm)
        self._submit(programs, f, t_i, wires, workers, kept)

    def _submit(self, programs: FragmentPrograms, f: int, t_i: int, wires, workers, kept) -> None:
        future = self._runner.submit(self._exchange, programs, wires, workers, kept)
        self._inflight[f] = (t_i, future)

    def _rows(self, arrays) -> dict[int, list[np.ndarray]]:
        rows: dict[int, list[np.ndarray]] = {}
        for x in arrays:
            seen = set()
            for shard in x.addressable_shards:
                pos = shard.index[0].start or 0
                if pos not in seen:
                    seen.add(pos)
                    rows.setdefault(pos, []).append(np.asarray(shard.data)[0])
        return rows

    def _by_slow(self, rows: dict[int, list[np.ndarray]], axis: int):
        """Each slow position's arrays: its ``L`` devices' rows (positions ``s L + l``) stacked
        on ``axis``, so that one message per peer carries them all."""
        size = self.fast_size
        out = {}
        for s in sorted({pos // size for pos in rows}):
            parts = [rows[s * size + i] for i in range(size)]
            out[s] = [
                np.expand_dims(parts[0][k], axis)
                if size == 1
                else np.stack([part[k] for part in parts], axis)
                for k in range(len(parts[0]))
            ]
        return out

    def _exchange(self, programs: FragmentPrograms, wires, workers, kept):
        try:
            return self._exchange_once(programs, wires, workers, kept)
        except SyncError:
            self._fail()  # the peers' exchanges fail now, not at their sync_timeout
            raise

    def _exchange_once(self, programs: FragmentPrograms, wires, workers, kept):
        size = self.fast_size
        flat, treedef = jax.tree.flatten(wires)
        # Row q of device (s, l) goes to device (q, l): rows (S, L, ...) per slow position.
        received = all_to_all(self._links, self._by_slow(self._rows(flat), 1), self.owner, self.me)

        def per_position(i, ref):
            def row(idx):
                pos = idx[0].start or 0
                return received[pos // size][i][:, pos % size][None]

            return jax.make_array_from_callback(ref.shape, self.split, row)

        received = jax.tree.unflatten(treedef, [per_position(i, x) for i, x in enumerate(flat)])
        wires, servers = programs.server(received, kept)
        flat, treedef = jax.tree.flatten(wires)
        # (S, L, ...) over the slow positions; finish takes (S, ...), or (L, S, ...) over a tuple.
        gathered = all_gather(self._links, self._by_slow(self._rows(flat), 0), self.owner, self.me)
        gathered = [np.swapaxes(g, 0, 1) for g in gathered]
        gathered = [g if programs.plan.fast else g[0] for g in gathered]
        gathered = [
            jax.make_array_from_callback(g.shape, programs.gathered, lambda idx, g=g: g[idx])
            for g in gathered
        ]
        gathered = jax.tree.unflatten(treedef, gathered)
        mean, flags = programs.finish(gathered, workers, servers, kept)
        if not flags:
            return mean, None
        keep, count, servers = flags  # the server residuals as the guard settled them
        keep_old = {pos for pos, (flag,) in self._rows([keep]).items() if flag}
        return mean, (workers, servers, count, keep_old)

    def _merge(self, state, f: int, t_i: int, future):
        timeout = self.spec.sync_timeout
        try:
            mean, result = future.result(timeout=timeout)
        except (concurrent.futures.TimeoutError, SyncError) as err:
            self._fail()
            if isinstance(err, SyncError):
                raise SyncError(
                    f"jaxcomm: DiLoCo's background sync of fragment {f} (issued at step {t_i}) "
                    f"failed: {err}"
                ) from err
            raise SyncError(
                f"jaxcomm: DiLoCo's background sync of fragment {f} (issued at step {t_i}) did "
                f"not finish within sync_timeout={timeout:g} s: a process hung or the link is "
                "too slow; stopping instead of merging a stale outer gradient"
            ) from err
        diloco = find_diloco(state.opt_state)
        inflight, comms = list(diloco.inflight), list(diloco.comm)
        inflight[f] = list(mean)
        if result is not None:
            comms[f] = self._guarded(comms[f], *result)
        opt_state = _replace_diloco(state.opt_state, inflight=tuple(inflight), comm=tuple(comms))
        return state._replace(opt_state=opt_state)

    def _guarded(self, old: ReduceState, workers, servers, count, keep_old) -> ReduceState:
        """The non-finite guard's new state: the new residuals, but the old ones (still in the
        state: the steps in flight pass them through) on the positions in ``keep_old``."""
        buckets = tuple(TwoStageState(w, s) for w, s in zip(workers, servers, strict=True))
        if keep_old:
            buckets = jax.tree.map(lambda a, b: take_rows(a, b, keep_old), buckets, old.buckets)
        return ReduceState(buckets, count)

    def _fail(self) -> None:
        """A sync failed: tell the peers (closed connections) and bound this process's exit."""
        self._failed = True
        bound_exit(EXIT_GRACE_S)
        self.close()

    def drain(self) -> None:
        """Wait for the syncs in flight (none after a failure), each up to ``sync_timeout``."""
        for _, future in list(self._inflight.values()):
            if self._failed:
                break
            with contextlib.suppress(Exception):
                future.result(timeout=self.spec.sync_timeout)

    def close(self) -> None:
        self._runner.close()
        self._links.close()
