"""jc.diloco(background=True) over a tuple of axes, slowest first: the sync's exact steps inside
a node run in its device programs, only the shares' compressed wires leave them (across
``host``), and the result is the single-program tuple DiLoCo's, bit for bit.

A 2 x 4 mesh of the simulated CPU devices stands in for 2 nodes of 4 devices, all in this
process (its exchanges move in memory); ``tests/integration/test_multihost.py``
(``diloco_tuple_bg``) runs the same comparison on 2 processes of 4 devices, whose exchanges
cross TCP.

Why bit for bit: both paths run the same arithmetic in the same order (the exact
reduce-scatter over ``local`` of :func:`jaxcomm.comm.two_level.scatter_share`, the codec's
stages of :mod:`jaxcomm.compressors.staged` on the share, the exact all-gather over
``local``), and the host only moves bytes between them. The exact mean sums the 2 hosts'
chunks, which is commutative, so it agrees with ``lax.psum`` too (for more than 2 hosts it is
within ``S - 1`` fp32 roundings of it: :class:`jaxcomm.compressors.exact.ExactCodec`).
"""

import functools
import types

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomm as jc
from jaxcomm.optim.diloco.background import BackgroundSync
from tests.optim.test_diloco_background import assert_same_bits
from tests.optim.test_diloco_two_level import (
    AXES,
    HYPER,
    L,
    S,
    loss_fn,
    make_batches,
    make_params,
    same_within_nodes,
)


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((S, L), AXES, axis_types=(AxisType.Auto,) * 2)


def _tx(background, compressor, H, F, tau, **kw):
    return jc.diloco(
        optax.sgd(HYPER["inner_lr"], momentum=HYPER["inner_mom"]),
        optax.sgd(HYPER["outer_lr"], momentum=HYPER["outer_mom"], nesterov=True),
        H,
        AXES,
        compressor=compressor,
        fragments=F,
        overlap_steps=tau,
        background=background,
        **kw,
    )


def _run(mesh, tx, batches, each=None, step=None, state=None):
    if step is None:
        step, state = jc.make_train_step(mesh, AXES, loss_fn, tx, make_params())
    for t, batch in enumerate(batches, start=1):
        if each is not None:
            state = each(t, state)
        state, _ = step(state, batch)
    return state


@functools.cache
def _compiled(mesh, background, compressor, H, F, tau, bucket_bytes):
    """A configuration's train step and its initial state (host arrays and their shardings),
    compiled once for every test that runs it (compiling is nearly all of a run's time). The
    single-program step is a pure function of its input state. The background step is given
    a state it did not produce at the start of each run, so it resumes from it as a new
    step's first call does (at step 0 nothing is in flight to reissue), and the runs sharing
    it end between syncs."""
    tx = _tx(background, compressor, H, F, tau, bucket_bytes=bucket_bytes)
    # Each program compiles when a run first needs it (the same programs, without those the
    # runs never use: a resumed sync's, the compile-ahead's schedule reader);
    # tests/train/test_no_midrun_compile.py checks compiling ahead gives the same bits.
    step, state = jc.make_train_step(mesh, AXES, loss_fn, tx, make_params(), precompile=False)
    return step, jax.tree.map(np.asarray, state), jax.tree.map(lambda x: x.sharding, state)


def _shared(mesh, background, compressor, H, F, tau, bucket_bytes):
    """The shared step and a fresh copy of its initial state (the step donates its input)."""
    step, arrays, shardings = _compiled(mesh, background, compressor, H, F, tau, bucket_bytes)
    return step, jax.device_put(arrays, shardings)


def _shared_run(mesh, background, compressor, H, F, tau, bucket_bytes, batches, each=None):
    step, state = _shared(mesh, background, compressor, H, F, tau, bucket_bytes)
    return _run(mesh, None, batches, each, step, state)


CASES = [
    ("exact", None, 6, 1, 3, None),
    ("int4-ef", jc.Quantize(bits=4, error_feedback=True), 6, 1, 3, None),
    ("int8-ef-F2", jc.Quantize(bits=8, error_feedback=True), 8, 2, 3, None),
    ("int8-ef-2-buckets", jc.Quantize(bits=8, error_feedback=True), 6, 1, 3, 16),
    ("int4-no-ef-F2", jc.Quantize(bits=4), 6, 2, 2, None),
    ("bf16", jc.Cast(), 4, 1, 2, None),
    ("onebit", jc.OneBit(), 6, 1, 3, None),
    ("onebit-F2", jc.OneBit(), 8, 2, 3, None),
]


@pytest.mark.parametrize(
    "compressor, H, F, tau, bucket_bytes", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_background_over_the_tuple_equals_the_single_program_bit_for_bit(
    mesh2d, compressor, H, F, tau, bucket_bytes
):
    batches = make_batches(3 * H)  # ends between syncs: nothing in flight
    want = _shared_run(mesh2d, False, compressor, H, F, tau, bucket_bytes, batches)
    got = _shared_run(mesh2d, True, compressor, H, F, tau, bucket_bytes, batches)
    assert_same_bits(got, want)
    same_within_nodes(got)
    if getattr(compressor, "error_feedback", False):
        comm = got.opt_state.comm[0]
        assert int(np.asarray(comm.nonfinite).sum()) == 0
        worker = np.asarray(comm.buckets[0].worker_error)
        assert worker.shape[0] == S * L  # one share's error feedback per device
        assert np.abs(worker).max() > 0  # the error feedback did move


INT4 = jc.Quantize(bits=4, error_feedback=True)
NONFINITE = [
    # (id, compressor, residual, value, bucket_bytes, fast position l, syncs skipped)
    ("int4-worker-inf", INT4, "worker_error", np.inf, None, 0, 1),
    ("onebit-worker-inf", jc.OneBit(), "worker_error", np.inf, None, 0, 1),
    ("onebit-server-overflow", jc.OneBit(), "server_error", 3e38, None, 3, 1),
    ("onebit-2-buckets", jc.OneBit(), "server_error", 3e38, 16, 0, 1),
    ("onebit-2-buckets-padding", jc.OneBit(), "server_error", 3e38, 16, 3, 0),
]


@pytest.mark.parametrize(
    "compressor, field, value, bucket_bytes, fast, skipped",
    [c[1:] for c in NONFINITE],
    ids=[c[0] for c in NONFINITE],
)
def test_a_nonfinite_share_is_guarded_as_in_the_single_program(
    mesh2d, compressor, field, value, bucket_bytes, fast, skipped
):
    """Device (host 0, local ``fast``)'s first residual element set to ``value`` before the
    sync after step 6 (issued in step 7, merged in step 9). Its share is not finite on both
    hosts: those devices count it and the guard keeps or restarts their share's residuals,
    the others' residuals move on (one bucket) or, when the mean is not finite, the skipped
    sync keeps every bucket's (two buckets); the background run stays the single program's,
    bit for bit. With two buckets the first bucket (``b``, 3 elements) has one element per
    share, so share 3 is all padding: its overflow never reaches the mean, and the sync is
    taken, in both paths."""
    batches = make_batches(12)

    def poison(t, state):
        if t != 7:
            return state
        comm = state.opt_state.comm[0]
        bucket = comm.buckets[0]
        bucket = bucket._replace(**{field: getattr(bucket, field).at[fast, 0].set(value)})
        comms = (comm._replace(buckets=(bucket, *comm.buckets[1:])),)
        return state._replace(opt_state=state.opt_state._replace(comm=comms))

    # Both steps are the bit-for-bit test's of the same configuration, or shared by the cases.
    want = _shared_run(mesh2d, False, compressor, 6, 1, 3, bucket_bytes, batches, poison)
    got = _shared_run(mesh2d, True, compressor, 6, 1, 3, bucket_bytes, batches, poison)
    assert_same_bits(got, want)
    counts = np.asarray(got.opt_state.comm[0].nonfinite).reshape(S, L)
    np.testing.assert_array_equal(counts, [np.arange(L) == fast] * S)  # that share, both hosts
    assert int(got.opt_state.skips.total) == skipped
    assert len(got.opt_state.comm[0].buckets) == (1 if bucket_bytes is None else 2)


def test_a_restored_state_reissues_the_sync_over_the_tuple(mesh2d):
    """A state saved while a sync is in flight (after steps 5 and 6; H=8, F=2, tau=3: fragment
    0 is issued in step 5 and merged in step 7) and given to a new step (the second rewound
    into it): the step reissues the sync from the pending pseudo-gradients (the worker program,
    with its fast reduce-scatter) and the run ends bit for bit where the uninterrupted one
    does."""
    compressor = jc.Quantize(bits=8, error_feedback=True)
    batches = make_batches(12)
    step, state = _shared(mesh2d, True, compressor, 8, 2, 3, None)  # the int8-ef-F2 case's
    saved = {}
    for t, batch in enumerate(batches, start=1):
        state, _ = step(state, batch)
        if t in (5, 6):
            saved[t] = jax.tree.map(np.asarray, state), jax.tree.map(lambda x: x.sharding, state)
            assert np.abs(np.asarray(state.opt_state.local.pending[0][0])).max() > 0
    final = jax.tree.map(np.asarray, state)
    # The state after step 6 goes to the new step after its run from step 5: the same path
    # for a state the step did not produce, without compiling a step per state.
    tx = _tx(True, compressor, 8, 2, 3)
    fresh, _ = jc.make_train_step(mesh2d, AXES, loss_fn, tx, make_params())
    for t, (arrays, shardings) in saved.items():
        restored = jax.device_put(arrays, shardings)  # as a checkpoint restores it
        for batch in batches[t:]:
            restored, _ = fresh(restored, batch)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(final), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)


class _Device:
    def __init__(self, process_index):
        self.process_index = process_index


def test_a_slow_position_spanning_processes_is_refused():
    """The host links move wires between processes along the slow axis only: a mesh whose
    ``host`` row spans two processes is refused when the step is built, with the fix."""
    devices = np.array([[_Device(0), _Device(0)], [_Device(0), _Device(1)]], dtype=object)
    mesh = types.SimpleNamespace(
        shape={"host": 2, "local": 2}, axis_names=("host", "local"), devices=devices
    )
    tx = _tx(True, jc.Quantize(bits=4, error_feedback=True), 4, 1, 2)
    with pytest.raises(ValueError, match=r"each position of 'host' on one process.*make_mesh"):
        BackgroundSync(tx.update, mesh, AXES)


def test_tuple_background_is_accepted_with_its_axes():
    tx = _tx(True, None, 4, 1, 2)
    assert tx.update.spec.axis_name == AXES
    with pytest.raises(ValueError, match="1-D shares"):
        _tx(True, jc.PowerSGD(), 4, 1, 2)


@pytest.mark.parametrize(
    "compressor", [None, jc.Quantize(bits=8, error_feedback=True)], ids=["exact", "int8-ef"]
)
def test_four_hosts_of_two(compressor):
    """A 4 x 2 mesh: the stages run over 4 hosts, still bit for bit. For the exact mean this
    holds where ``lax.psum`` sums the hosts in order (XLA:CPU, here); elsewhere the two may
    differ by that order, ``S - 1`` fp32 roundings (:class:`~jaxcomm.compressors.ExactCodec`)."""
    mesh = jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Auto,) * 2)
    batches = make_batches(12)
    want = _run(mesh, _tx(False, compressor, 4, 1, 2), batches)
    got = _run(mesh, _tx(True, compressor, 4, 1, 2), batches)
    assert_same_bits(got, want)
