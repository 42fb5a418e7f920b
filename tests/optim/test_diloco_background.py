"""jc.diloco(background=True): the outer sync on a host thread gives the single-program result.

The reference is the single-program ``overlap_steps=tau`` (whose own reference is the NumPy
model of ``test_diloco.py``) and, for the exact mean, that NumPy model itself. The compressed
chains run the compressor's own arithmetic in both paths and only move bytes in between, so
they must agree bit for bit; the exact mean sums the devices' chunks in device order, as
``lax.psum`` does on XLA:CPU.
"""

import functools
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm as jc
from jaxcomm.optim.diloco import background as diloco_background
from jaxcomm.runtime.host_links import SyncError
from tests.optim.test_diloco import (
    HYPER,
    B,
    check_against,
    loss_fn,
    make_batches,
    make_mesh,
    make_params,
    make_tx,
)
from tests.optim.test_diloco import numpy_streaming as numpy_reference


def _tx(background, compressor, H, F, tau, **kw):
    return jc.diloco(
        optax.adam(0.01),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        H,
        "dp",
        compressor=compressor,
        fragments=F,
        overlap_steps=tau,
        background=background,
        **kw,
    )


def _run(mesh, tx, batches, state=None, step=None):
    if step is None:
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, make_params())
    for batch in batches:
        state, _ = step(state, batch)
    return state


@functools.cache
def _compiled(mesh, background, compressor, H, F, tau, bucket_bytes=None):
    """A configuration's train step and its initial state (host arrays and their shardings),
    compiled once for every test that runs it (compiling is nearly all of a run's time). The
    single-program step is a pure function of its input state. The background step is given
    a state it did not produce at the start of each run, so it resumes from it as a new
    step's first call does (at step 0 nothing is in flight to reissue), and the runs sharing
    it end between syncs; the tests that break a step's sync keep steps of their own."""
    tx = _tx(background, compressor, H, F, tau, bucket_bytes=bucket_bytes)
    # Each program compiles when a run first needs it (the same programs, without those the
    # runs never use: a resumed sync's, the compile-ahead's schedule reader);
    # tests/train/test_no_midrun_compile.py checks compiling ahead gives the same bits.
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, make_params(), precompile=False)
    return step, jax.tree.map(np.asarray, state), jax.tree.map(lambda x: x.sharding, state)


def _shared(mesh, background, compressor, H, F, tau, bucket_bytes=None):
    """The shared step of a configuration and a fresh copy of its initial state (the step
    donates its input)."""
    step, arrays, shardings = _compiled(mesh, background, compressor, H, F, tau, bucket_bytes)
    return step, jax.device_put(arrays, shardings)


def _shared_run(mesh, background, compressor, H, F, tau, batches, bucket_bytes=None, each=None):
    """The shared step's run on ``batches``; ``each(t, state)`` may change the state before
    step ``t``."""
    step, state = _shared(mesh, background, compressor, H, F, tau, bucket_bytes)
    for t, batch in enumerate(batches, start=1):
        if each is not None:
            state = each(t, state)
        state, _ = step(state, batch)
    return state


def _without_pending(state):
    """Every leaf but DiLoCo's pending pseudo-gradients (which only the background path has)."""
    diloco = state.opt_state
    local = diloco.local._replace(pending=())
    return jax.tree.leaves(state._replace(opt_state=diloco._replace(local=local)))


def assert_same_bits(got, want):
    """The two train states hold the same bits, DiLoCo's pending pseudo-gradients aside."""
    for a, b in zip(_without_pending(got), _without_pending(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "compressor, H, F, tau",
    [
        (jc.Quantize(bits=4, error_feedback=True), 6, 1, 3),
        (jc.Quantize(bits=8, error_feedback=True), 8, 2, 3),
        (jc.Quantize(bits=4), 6, 2, 2),
        (jc.Cast(), 4, 1, 2),
        (jc.OneBit(), 6, 1, 3),
        (jc.OneBit(), 8, 2, 3),
    ],
    ids=["int4-ef", "int8-ef-F2", "int4-no-ef-F2", "bf16", "onebit", "onebit-F2"],
)
def test_background_equals_the_single_program_bit_for_bit(mesh, compressor, H, F, tau):
    batches = make_batches(3 * H)  # ends between syncs: nothing in flight
    want = _shared_run(mesh, False, compressor, H, F, tau, batches)
    got = _shared_run(mesh, True, compressor, H, F, tau, batches)
    assert_same_bits(got, want)
    if getattr(compressor, "error_feedback", False):
        assert int(np.asarray(got.opt_state.comm[0].nonfinite).sum()) == 0
        worker = np.asarray(got.opt_state.comm[0].buckets[0].worker_error)
        assert np.abs(worker).max() > 0  # the error feedback did move


@pytest.mark.parametrize("H, F, tau", [(6, 1, 3), (6, 2, 2)], ids=["F1-tau3", "F2-tau2"])
def test_exact_background_matches_numpy(mesh, H, F, tau):
    params, batches = make_params(), make_batches(13)
    state = _run(mesh, make_tx(H, fragments=F, overlap_steps=tau, background=True), batches)
    theta, xs = numpy_reference(params, batches, H=H, F=F, tau=tau, alpha=0.0, **HYPER)
    check_against(state, theta, xs)


@pytest.mark.parametrize(
    "compressor", [jc.Quantize(bits=8, error_feedback=True), jc.OneBit()], ids=["int8", "onebit"]
)
def test_checkpoint_mid_flight_resumes_bit_for_bit(mesh, tmp_path, compressor):
    # H=8, F=2, tau=3: fragment 0 syncs after step 4, is issued in step 5 and merged in step
    # 7: states after steps 5 and 6 are mid-flight (pending holds the pseudo-gradients).
    batches = make_batches(12)
    step, state = _shared(mesh, True, compressor, 8, 2, 3)  # the bit-for-bit test's F2 step
    checkpointer = ocp.StandardCheckpointer()
    saved = {}
    for t, batch in enumerate(batches, start=1):
        state, _ = step(state, batch)
        if t in (5, 6):
            saved[t] = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            checkpointer.save(tmp_path / f"step{t}", state)
            checkpointer.wait_until_finished()
            assert np.abs(np.asarray(state.opt_state.local.pending[0][0])).max() > 0
    final = jax.tree.map(np.asarray, state)
    # A new process: a new transformation and step, which reissues the sync in flight from the
    # state. The state after step 5 resumes with one step passing pending on before the merge;
    # the one after step 6 (the merge follows the reissue at once) is then given to that same
    # step, rewound: the same path for a state the step did not produce, without compiling it
    # all again.
    tx = _tx(True, compressor, 8, 2, 3)
    fresh, _ = jc.make_train_step(mesh, "dp", loss_fn, tx, make_params())
    for t in (5, 6):
        restored = checkpointer.restore(tmp_path / f"step{t}", saved[t])
        restored = _run(mesh, tx, batches[t:], restored, fresh)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(final), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    checkpointer.close()


def test_a_failed_exchange_stops_the_step_that_needs_it(mesh, monkeypatch):
    def broken(*args, **kw):
        raise SyncError("jaxcomm: process 1 closed its connection during a DiLoCo sync")

    monkeypatch.setattr(diloco_background, "all_to_all", broken)
    tx = _tx(True, jc.Quantize(bits=4, error_feedback=True), 4, 1, 2)
    with pytest.raises(SyncError, match=r"fragment 0 \(issued at step 5\) failed: .*closed"):
        _run(mesh, tx, make_batches(8))


def test_a_hung_exchange_times_out(mesh, monkeypatch):
    release = []

    def hung(*args, **kw):
        while not release:
            time.sleep(0.05)
        raise SyncError("released")

    monkeypatch.setattr(diloco_background, "all_to_all", hung)
    tx = _tx(True, jc.Quantize(bits=4, error_feedback=True), 4, 1, 2, sync_timeout=1.0)
    start = time.monotonic()
    try:
        with pytest.raises(SyncError, match="did not finish within sync_timeout=1 s"):
            _run(mesh, tx, make_batches(8))
    finally:
        release.append(True)
    assert time.monotonic() - start < 60


def test_bad_input_is_refused(mesh):
    inner, outer = optax.sgd(0.1), optax.sgd(1.0)
    with pytest.raises(ValueError, match="overlap_steps >= 2"):
        jc.diloco(inner, outer, 8, "dp", overlap_steps=1, background=True)
    with pytest.raises(ValueError, match="needs a staged codec"):
        jc.diloco(inner, outer, 8, "dp", jc.TopK(0.1), overlap_steps=2, background=True)
    with pytest.raises(ValueError, match="sync_timeout"):
        jc.diloco(inner, outer, 8, "dp", overlap_steps=2, background=True, sync_timeout=0)
    tx = jc.diloco(inner, outer, 8, "dp", overlap_steps=2, background=True)
    step, state = jc.make_pmap_train_step("dp", loss_fn, tx, make_params())
    with pytest.raises(ValueError, match="pass the transformation itself to jc.make_train_step"):
        step(state, make_batches(1)[0])
    # Inside optax.chain nothing would run the syncs: refused, not a run without outer steps.
    chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, chained, make_params())
    assert step.background is None
    with pytest.raises(ValueError, match="not inside optax.chain"):
        step(state, make_batches(1)[0])


def test_the_background_sync_is_the_steps_own_object(mesh):
    """``step.background`` holds the thread and the links, and is the driver attached to the
    transformation's update; before a sync is due its hooks leave the state as it is."""
    tx = _tx(True, jc.Quantize(bits=4, error_feedback=True), 4, 1, 2)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, make_params())
    sync = step.background
    assert isinstance(sync, diloco_background.BackgroundSync)
    assert tx.update.driver is sync and tx.update.spec.overlap_steps == 2
    assert sync.perform_sync(state) is state and sync.prepare_sync(state) is state


def test_local_metrics_are_each_devices_loss(mesh):
    """``mean_metrics=False``: the step's loss is each device's own, on its rows and its local
    parameters (no all-reduce in the inner steps)."""
    tx = _tx(True, jc.Quantize(bits=4, error_feedback=True), 4, 1, 2)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, make_params(), mean_metrics=False)
    for x, y in make_batches(6):
        b, w = (np.asarray(p, np.float64) for p in jax.tree.leaves(state.params))
        state, losses = step(state, (x, y))
        assert losses.shape == (8,)
        for r in range(8):
            rows = slice(r * 2, (r + 1) * 2)
            want = np.mean((x[rows] @ w[r] + b[r] - y[rows]) ** 2)
            np.testing.assert_allclose(float(losses[r]), want, rtol=1e-5)


def test_resize_with_a_sync_in_flight_continues_as_the_single_program(mesh):
    """8 -> 4 devices between the step that issues a sync and the one that merges it: the
    pending pseudo-gradients are averaged, the first step on 4 devices reissues the sync from
    them, and the exact mean gives the single-program run resized at the same step."""
    batches = make_batches(10)

    def resized(background):
        # H=4, tau=3: the sync after step 4 is issued in step 5 and merged in step 7.
        tx = make_tx(4, overlap_steps=3, background=background)
        state = jax.tree.map(np.asarray, _run(mesh, tx, batches[:5]))
        new = jc.resize_diloco_state(state, None, new_axis_size=4)
        step4, template = jc.make_train_step(make_mesh(4), "dp", loss_fn, tx, make_params())
        moved = jax.device_put(new, jax.tree.map(lambda x: x.sharding, template))
        for x, y in batches[5:]:  # merges the sync in flight, then syncs after step 8
            moved, _ = step4(moved, (x[: 4 * B], y[: 4 * B]))
        return state, new, jax.tree.map(np.asarray, moved)

    old, new, got = resized(True)
    pending = old.opt_state.local.pending[0]
    assert np.abs(pending[1]).max() > 0  # a sync is in flight (w)
    for a, b in zip(new.opt_state.local.pending[0], pending, strict=True):
        np.testing.assert_allclose(a, np.broadcast_to(b.mean(0), a.shape), rtol=1e-6)
    _, _, want = resized(False)
    # Only the mean's fp32 summation order differs (NumPy's over 8 rows, then 4 equal rows,
    # against the 8-device reduction): a few roundings, carried through 5 steps.
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=32 * np.finfo(np.float32).eps)


@pytest.mark.parametrize(
    "compressor, field, value, bucket_bytes, kept",
    [
        (jc.Quantize(bits=4, error_feedback=True), "worker_error", np.inf, None, True),
        (jc.OneBit(), "worker_error", np.inf, None, True),
        (jc.OneBit(), "server_error", 3e38, None, False),
        (jc.OneBit(), "server_error", 3e38, 16, True),
    ],
    ids=["int4-worker-inf", "onebit-worker-inf", "onebit-server-overflow", "onebit-2-buckets"],
)
def test_a_nonfinite_sync_keeps_the_error_feedback_as_the_single_program(
    mesh, compressor, field, value, bucket_bytes, kept
):
    """Device 3's first residual element set to ``value`` before the sync after step 6 (issued
    in step 7, merged in step 9). An infinite worker residual makes the mean not finite: every
    device keeps its old residuals. A server residual of 3e38 overflows OneBit's server norm with
    finite inputs: one bucket restarts its server residuals from zero, and with two buckets the
    skipped sync keeps every bucket's. Each time every device counts the skip and the background
    run stays the single program's, bit for bit."""
    batches = make_batches(12)

    def poison(t, state):
        if t != 7:
            return state
        comm = state.opt_state.comm[0]
        bucket = comm.buckets[0]
        bucket = bucket._replace(**{field: getattr(bucket, field).at[3, 0].set(value)})
        comms = (comm._replace(buckets=(bucket, *comm.buckets[1:])),)
        return state._replace(opt_state=state.opt_state._replace(comm=comms))

    # Both steps are the bit-for-bit test's of the same configuration, or shared by the cases.
    want = _shared_run(mesh, False, compressor, 6, 1, 3, batches, bucket_bytes, poison)
    got = _shared_run(mesh, True, compressor, 6, 1, 3, batches, bucket_bytes, poison)
    counts = np.asarray(got.opt_state.comm[0].nonfinite)
    np.testing.assert_array_equal(counts, np.full((8, 1), 1))  # the sync after step 6
    residual = np.asarray(getattr(got.opt_state.comm[0].buckets[0], field))
    if kept:
        assert residual[3, 0] == np.float32(value)
    else:
        np.testing.assert_array_equal(residual, 0.0)
    assert_same_bits(got, want)


def test_take_rows_swaps_whole_rows(mesh):
    """The guard's per-device choice: rows of ``old`` at the given positions, ``new`` elsewhere
    (against NumPy's row selection)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    new = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    old = -new - 1
    got = diloco_background.take_rows(
        jax.device_put(new, sharding), jax.device_put(old, sharding), {1, 6}
    )
    want = np.where(np.isin(np.arange(8), [1, 6])[:, None], old, new)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.sharding == sharding
