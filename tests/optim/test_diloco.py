"""jc.diloco (DiLoCo, Streaming DiLoCo) against NumPy models written from the papers.

References (float64, written from arXiv:2311.08105 and arXiv:2501.18512 as summarised in the
design notes, not from jaxcomm's code): every device runs inner SGD with momentum on its slice
of the batch; fragment ``f`` (leaves ``i % F == f``) records ``mean_r(theta_f - x_r,f)`` after
the steps ``t % H == o_f`` and, ``tau`` steps later, applies outer SGD (Nesterov) to ``theta_f``
and mixes ``x_r,f = alpha x_r,f + (1 - alpha) theta_f``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm as jc
from tests.conftest import make_mesh

N = 8
IN, OUT = 5, 3
B = 2  # examples per device


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def numpy_grads(leaves, x, y):
    """Gradients of ``loss_fn`` for leaves ``[b, w]`` (tree order of the dict), float64."""
    b, w = leaves
    err = x @ w + b - y
    scale = 2.0 / err.size
    return [scale * err.sum(axis=0), scale * x.T @ err]


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(IN, OUT)).astype(np.float32),
        "b": rng.normal(size=(OUT,)).astype(np.float32) * 0.1,
    }


def pending_sum(comm, n: int, numel: int) -> np.ndarray:
    """The error feedback's untransmitted sum ``T`` of one bucket (``compressed_psum`` units),
    from the stacked per-device state: worker residuals summed plus ``n`` times the server
    residuals (chunk ``r`` on device ``r``), or the summed top-k residuals."""
    (bucket,) = comm.buckets
    if hasattr(bucket, "server_error"):
        worker = np.asarray(bucket.worker_error, np.float64)[:, :numel].sum(0)
        return worker + n * np.asarray(bucket.server_error, np.float64).reshape(-1)[:numel]
    return np.asarray(bucket.error, np.float64)[:, :numel].sum(0)


def make_batches(count, seed=1, nan_at=()):
    """``count`` batches; at the (0-based) steps ``nan_at`` (an int or several) one example of
    device 3 is NaN."""
    rng = np.random.default_rng(seed)
    nan_at = {nan_at} if isinstance(nan_at, int) else set(nan_at)
    out = []
    for t in range(count):
        x = rng.normal(size=(N * B, IN)).astype(np.float32)
        y = rng.normal(size=(N * B, OUT)).astype(np.float32)
        if t in nan_at:
            x[3 * B, 0] = np.nan  # one example of device 3
        out.append((x, y))
    return out


def numpy_diloco(params, batches, *, H, inner_lr, inner_mom, outer_lr, outer_mom, skip=()):
    """Plain DiLoCo: H local steps, then theta -= outer(mean_r(theta - x_r)), x_r = theta.
    ``(t, r)`` in ``skip``: device r does not step at step t (its input was not finite)."""
    theta = [np.asarray(params[k], np.float64) for k in ("b", "w")]
    xs = [[p.copy() for p in theta] for _ in range(N)]
    inner_m = [[np.zeros_like(p) for p in theta] for _ in range(N)]
    outer_m = [np.zeros_like(p) for p in theta]
    for t, (x, y) in enumerate(batches, start=1):
        for r in range(N):
            if (t, r) in skip:
                continue
            grads = numpy_grads(xs[r], x[r * B : (r + 1) * B], y[r * B : (r + 1) * B])
            for i, g in enumerate(grads):
                inner_m[r][i] = g + inner_mom * inner_m[r][i]
                xs[r][i] = xs[r][i] - inner_lr * inner_m[r][i]
        if t % H == 0:
            for i in range(len(theta)):
                delta = np.mean([theta[i] - xs[r][i] for r in range(N)], axis=0)
                outer_m[i] = delta + outer_mom * outer_m[i]
                theta[i] = theta[i] - outer_lr * (delta + outer_mom * outer_m[i])  # Nesterov
            xs = [[p.copy() for p in theta] for _ in range(N)]
    return theta, xs


def numpy_streaming(params, batches, *, H, F, tau, alpha, inner_lr, inner_mom, outer_lr, outer_mom):
    """Streaming DiLoCo: fragment f records its outer gradient after steps t % H == o_f and
    applies it tau steps later, mixing the local copies with alpha."""
    theta = [np.asarray(params[k], np.float64) for k in ("b", "w")]
    xs = [[p.copy() for p in theta] for _ in range(N)]
    inner_m = [[np.zeros_like(p) for p in theta] for _ in range(N)]
    outer_m = [np.zeros_like(p) for p in theta]
    offsets = [((f + 1) * H // F) % H for f in range(F)]
    pending = {}
    for t, (x, y) in enumerate(batches, start=1):
        for r in range(N):
            grads = numpy_grads(xs[r], x[r * B : (r + 1) * B], y[r * B : (r + 1) * B])
            for i, g in enumerate(grads):
                inner_m[r][i] = g + inner_mom * inner_m[r][i]
                xs[r][i] = xs[r][i] - inner_lr * inner_m[r][i]
        for f in range(F):
            ids = range(f, len(theta), F)
            if t % H == offsets[f]:
                pending[f] = {i: np.mean([theta[i] - xs[r][i] for r in range(N)], 0) for i in ids}
            if t - tau >= 1 and (t - tau) % H == offsets[f]:
                for i in ids:
                    delta = pending[f][i]
                    outer_m[i] = delta + outer_mom * outer_m[i]
                    theta[i] = theta[i] - outer_lr * (delta + outer_mom * outer_m[i])
                    for r in range(N):
                        xs[r][i] = alpha * xs[r][i] + (1 - alpha) * theta[i]
    return theta, xs


HYPER = dict(inner_lr=0.05, inner_mom=0.9, outer_lr=0.7, outer_mom=0.9)


def make_tx(H, **kw):
    return jc.diloco(
        optax.sgd(HYPER["inner_lr"], momentum=HYPER["inner_mom"]),
        optax.sgd(HYPER["outer_lr"], momentum=HYPER["outer_mom"], nesterov=True),
        H,
        "dp",
        **kw,
    )


def run(mesh, tx, params, batches):
    return run_from(*jc.make_train_step(mesh, "dp", loss_fn, tx, params), batches)


def run_from(step, initial, batches):
    """``step`` over ``batches`` from a copy of ``initial`` (kept: the step donates its input)."""
    state = jax.tree.map(jnp.copy, initial)
    for batch in batches:
        state, _ = step(state, batch)
    return state


@functools.cache
def _shared_step(mesh, H, tx_kw):
    return jc.make_train_step(mesh, "dp", loss_fn, make_tx(H, **dict(tx_kw)), make_params())


def run_shared(mesh, H, batches, **tx_kw):
    """``run(mesh, make_tx(H, **tx_kw), make_params(), batches)`` on a train step compiled
    once per configuration (jc.diloco's defaults filled in: ``make_tx(3)`` is the plain
    streaming case too), shared by the tests that run it."""
    tx_kw = dict(fragments=1, overlap_steps=0, alpha=0.0) | tx_kw
    return run_from(*_shared_step(mesh, H, tuple(sorted(tx_kw.items()))), batches)


def check_against(state, theta, xs, rtol=2e-5, atol=2e-6):
    got_theta = jc.diloco_params(state.opt_state)
    for got, want in zip(jax.tree.leaves(got_theta), theta, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=atol)
    for i, leaf in enumerate(jax.tree.leaves(state.params)):
        leaf = np.asarray(leaf)
        assert leaf.shape[0] == N  # per-device parameters
        for r in range(N):
            np.testing.assert_allclose(leaf[r], xs[r][i], rtol=rtol, atol=atol)


def test_h1_outer_sgd_lr1_is_data_parallel_sgd(mesh):
    params, batches = make_params(), make_batches(5)
    tx = jc.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "dp")
    state = run(mesh, tx, params, batches)
    ref = run(
        mesh,
        optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.sgd(0.1)),
        params,
        batches,
    )
    for got, local, want in zip(
        jax.tree.leaves(jc.diloco_params(state.opt_state)),
        jax.tree.leaves(state.params),
        jax.tree.leaves(ref.params),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        for r in range(N):  # every device restarted from theta
            np.testing.assert_allclose(np.asarray(local)[r], np.asarray(want), rtol=1e-6, atol=1e-6)


def test_exact_diloco_matches_numpy_over_several_syncs(mesh):
    params, batches = make_params(), make_batches(11)  # syncs after steps 3, 6, 9; 2 local steps
    state = run_shared(mesh, 3, batches)
    theta, xs = numpy_diloco(params, batches, H=3, **HYPER)
    check_against(state, theta, xs)
    assert int(state.opt_state.count) == 11 and int(state.opt_state.skips.total) == 0
    # The reference's local copies differ between devices (2 steps since the last sync).
    assert not np.allclose(xs[0][1], xs[1][1])


def test_numpy_streaming_with_one_fragment_no_overlap_is_numpy_diloco():
    params, batches = make_params(), make_batches(9)
    plain = numpy_diloco(params, batches, H=3, **HYPER)
    streaming = numpy_streaming(params, batches, H=3, F=1, tau=0, alpha=0.0, **HYPER)
    for a, b in zip(plain[0], streaming[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "H, F, tau, alpha",
    [(3, 1, 0, 0.0), (4, 2, 0, 0.0), (6, 2, 2, 0.0), (4, 2, 1, 0.5)],
    ids=["plain", "F2", "F2-tau2", "F2-tau1-alpha0.5"],
)
def test_streaming_matches_numpy(mesh, H, F, tau, alpha):
    params, batches = make_params(), make_batches(13)
    state = run_shared(mesh, H, batches, fragments=F, overlap_steps=tau, alpha=alpha)
    theta, xs = numpy_streaming(params, batches, H=H, F=F, tau=tau, alpha=alpha, **HYPER)
    check_against(state, theta, xs)


def _step_and_states(mesh, tx, params, batches):
    """States before every step, and the final state (a copy kept of each: steps donate)."""
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    states = []
    for batch in batches:
        states.append(jax.tree.map(np.asarray, state))
        state, _ = step(state, batch)
    states.append(jax.tree.map(np.asarray, state))
    return states


@pytest.mark.parametrize(
    "compressor",
    [jc.Quantize(bits=4, error_feedback=True), jc.TopK(0.25)],
    ids=["int4-ef", "topk-ef"],
)
def test_error_feedback_identity_across_syncs(mesh, compressor):
    """sum_k n * Delta_k + T_end == sum_k sum_r (theta_k - x_{k,r}): the compressed outer
    gradients plus the pending error feedback add up to the exact pseudo-gradients."""
    lr, H = 0.1, 2
    tx = jc.diloco(optax.sgd(lr), optax.sgd(1.0), H, "dp", compressor=compressor)
    params, batches = make_params(), make_batches(6)
    states = _step_and_states(mesh, tx, params, batches)
    numel = sum(x.size for x in jax.tree.leaves(params))
    sent, exact = np.zeros(numel), np.zeros(numel)
    for t in range(H, len(batches) + 1, H):  # the sync steps (1-based)
        before, after = states[t - 1], states[t]
        theta = [np.asarray(x, np.float64) for x in jax.tree.leaves(before.opt_state.outer_params)]
        new_theta = jax.tree.leaves(after.opt_state.outer_params)
        sent += N * np.concatenate([(a - b).ravel() for a, b in zip(theta, new_theta, strict=True)])
        x, y = batches[t - 1]
        for r in range(N):
            local = [np.asarray(p[r], np.float64) for p in jax.tree.leaves(before.params)]
            grads = numpy_grads(local, x[r * B : (r + 1) * B], y[r * B : (r + 1) * B])
            exact += np.concatenate(
                [(th - (p - lr * g)).ravel() for th, p, g in zip(theta, local, grads, strict=True)]
            )
        pending = pending_sum(after.opt_state.comm[0], N, numel)
        assert np.abs(pending).max() > 0  # compression left something behind
        np.testing.assert_allclose(sent + pending, exact, rtol=1e-4, atol=1e-5)
        # ... and dropping the error feedback would not satisfy it.
        assert not np.allclose(sent, exact, rtol=1e-4, atol=1e-5)


def test_checkpoint_resume_is_bit_exact_mid_interval_and_mid_flight(mesh, tmp_path):
    # H=8, F=2, tau=2: fragment 0 syncs after step 4, its reduction is issued in step 5 and
    # merged in step 6; saving after step 5 is mid-flight, after step 3 mid-interval.
    tx = jc.diloco(
        optax.adam(0.01),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        8,
        "dp",
        compressor=jc.Quantize(bits=8, error_feedback=True),
        fragments=2,
        overlap_steps=2,
    )
    params, batches = make_params(), make_batches(10)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    checkpointer = ocp.StandardCheckpointer()
    saved = {}
    for t, batch in enumerate(batches, start=1):
        state, _ = step(state, batch)
        if t in (3, 5):
            saved[t] = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            checkpointer.save(tmp_path / f"step{t}", state)
            checkpointer.wait_until_finished()
            if t == 5:  # in flight: fragment 0's reduced outer gradient waits for step 6
                assert np.abs(np.asarray(state.opt_state.inflight[0][0])).max() > 0
    final = jax.tree.map(np.asarray, state)
    for t, abstract in saved.items():
        restored = checkpointer.restore(tmp_path / f"step{t}", abstract)
        for batch in batches[t:]:
            restored, _ = step(restored, batch)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(final), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    checkpointer.close()


def test_resize_to_another_device_count(mesh):
    """8 -> 4 devices: local copies and inner states averaged, the error feedback's pending
    share of the mean kept, training continues; an un-resized state is refused at trace time."""
    compressor = jc.Quantize(bits=8, error_feedback=True)
    tx = jc.diloco(optax.sgd(0.05, momentum=0.9), optax.sgd(0.7), 4, "dp", compressor=compressor)
    params, batches = make_params(), make_batches(6)
    state = run(mesh, tx, params, batches)  # after step 6: mid-interval, error feedback set
    old = jax.tree.map(np.asarray, state)
    new = jc.resize_diloco_state(old, compressor, new_axis_size=4)
    for got, want in zip(jax.tree.leaves(new.params), jax.tree.leaves(old.params), strict=True):
        assert got.shape == (4, *want.shape[1:])
        np.testing.assert_allclose(got, np.broadcast_to(want.mean(0), got.shape), rtol=1e-6)
    inner_old = jax.tree.leaves(old.opt_state.local)
    for got, want in zip(jax.tree.leaves(new.opt_state.local), inner_old, strict=True):
        np.testing.assert_allclose(got[1], want.mean(0), rtol=1e-5, atol=1e-7)
    numel = sum(x.size for x in jax.tree.leaves(params))
    np.testing.assert_allclose(  # the pending part of the mean, T / n, is kept
        pending_sum(new.opt_state.comm[0], 4, numel) / 4,
        pending_sum(old.opt_state.comm[0], 8, numel) / 8,
        rtol=1e-5,
        atol=1e-7,
    )

    mesh4 = make_mesh(4)
    step4, template = jc.make_train_step(mesh4, "dp", loss_fn, tx, params)
    shardings = jax.tree.map(lambda x: x.sharding, template)
    moved = jax.device_put(new, shardings)
    batch4 = (batches[0][0][: 4 * B], batches[0][1][: 4 * B])
    for _ in range(3):  # crosses the sync after step 8
        moved, loss = step4(moved, batch4)
    assert np.isfinite(float(loss))
    assert np.asarray(moved.opt_state.devices).shape == (4,)
    with pytest.raises(ValueError, match="built for 8 devices"):
        step4.lower(jax.tree.map(jnp.asarray, old), batch4)


def test_nonfinite_inner_step_is_skipped_on_its_device(mesh):
    """A NaN example on device 3 at step 3: that device keeps its parameters and momentum for
    the step (counted per device), the others step on, the syncs go through."""
    params, batches = make_params(), make_batches(7, nan_at=2)
    state = run_shared(mesh, 3, batches)
    theta, xs = numpy_diloco(params, batches, H=3, skip={(3, 3)}, **HYPER)
    check_against(state, theta, xs)
    counts = np.asarray(state.opt_state.local.skips.total)
    np.testing.assert_array_equal(counts, [0, 0, 0, 1, 0, 0, 0, 0])
    assert int(state.opt_state.skips.total) == 0


def test_consecutive_nonfinite_steps_then_clean_ones(mesh):
    """Issue 15.3: NaN on device 3 for 3 steps in a row (steps 3-5), then clean steps through
    two more syncs: device 3 leaves exactly those steps out (the NumPy model with them
    skipped), the others step on, nothing non-finite reaches the outer reduction or its error
    feedback, the skips are counted and the in-a-row counter is back to 0."""
    params, batches = make_params(), make_batches(10, nan_at=(2, 3, 4))
    state = run_shared(mesh, 3, batches)
    theta, xs = numpy_diloco(params, batches, H=3, skip={(3, 3), (4, 3), (5, 3)}, **HYPER)
    check_against(state, theta, xs)
    local = state.opt_state.local
    np.testing.assert_array_equal(np.asarray(local.skips.total), [0, 0, 0, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(local.skips.consecutive), np.zeros(N))
    assert int(state.opt_state.skips.total) == 0 and int(state.opt_state.skips.consecutive) == 0
    int4 = run(mesh, make_tx(3, compressor=jc.Quantize(bits=4, error_feedback=True)), params,
               batches)  # fmt: skip
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(int4))
    np.testing.assert_array_equal(np.asarray(int4.opt_state.comm[0].nonfinite), np.zeros((N, 1)))


def test_more_consecutive_skips_than_allowed_stop_the_run(mesh):
    """Device 3 skips steps 1-3; at the sync after step 3 its streak (3) is compared (devices
    only talk at syncs) and exceeds max_consecutive_skips=2: a clear error, not silent
    training. At the limit (3) the run goes on."""
    params, batches = make_params(), make_batches(5, nan_at=(0, 1, 2))
    with pytest.raises(Exception, match="consecutive steps") as info:
        jax.block_until_ready(run(mesh, make_tx(3, max_consecutive_skips=2), params, batches))
    assert "max_consecutive_skips=2" in str(info.value)
    state = run(mesh, make_tx(3, max_consecutive_skips=3), params, batches)
    np.testing.assert_array_equal(np.asarray(state.opt_state.local.skips.total)[3], 3)


@pytest.mark.parametrize("bucket_bytes", [None, 16], ids=["one-bucket", "bucket-per-leaf"])
def test_nonfinite_outer_gradient_skips_the_sync(mesh, bucket_bytes):
    """A finite but huge local step on device 3 overflows the 1-bit scale of the outer
    gradient at the sync after step 4: theta and the outer state are kept, the local copies
    are not merged, the error feedback is kept, and both are counted. With a bucket per leaf
    only ``w``'s bucket overflows (``b``'s mean is finite): the skipped sync still keeps the
    error feedback of every bucket."""
    tx = jc.diloco(
        optax.sgd(0.05),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        2,
        "dp",
        compressor=jc.OneBit(),
        bucket_bytes=bucket_bytes,
    )
    batches = make_batches(4)
    batches[3][0][3 * B] = 1e12  # device 3, step 4: local copy ~1e22, its square overflows
    states = _step_and_states(mesh, tx, make_params(), batches)
    before, after = states[3], states[4]
    assert len(after.opt_state.comm[0].buckets) == (1 if bucket_bytes is None else 2)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after.params))
    assert int(before.opt_state.skips.total) == 0 and int(after.opt_state.skips.total) == 1
    assert int(after.opt_state.skips.consecutive) == 1  # in a row (max_consecutive_skips bounds it)
    np.testing.assert_array_equal(np.asarray(after.opt_state.comm[0].nonfinite), np.ones((N, 1)))
    for got, want in zip(
        jax.tree.leaves(
            (after.opt_state.outer_params, after.opt_state.outer, after.opt_state.comm[0].buckets)
        ),
        jax.tree.leaves(
            (
                before.opt_state.outer_params,
                before.opt_state.outer,
                before.opt_state.comm[0].buckets,
            )
        ),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    # Not merged: device 0's copy is its own inner step, not theta.
    x, y = batches[3]
    local = [np.asarray(p[0], np.float64) for p in jax.tree.leaves(before.params)]
    grads = numpy_grads(local, x[:B], y[:B])
    for got, p, g in zip(jax.tree.leaves(after.params), local, grads, strict=True):
        np.testing.assert_allclose(got[0], p - 0.05 * g, rtol=1e-5, atol=1e-6)
    assert not np.allclose(after.params["w"][0], after.opt_state.outer_params["w"])


def _overflowing_sgd(lr):
    """SGD whose update overflows (to -inf times the gradient's sign) once a gradient element
    passes 1e6: a finite gradient that leaves the local copy non-finite."""

    def update(grads, state, params=None):
        big = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)])) > 1e6
        return jax.tree.map(lambda g: -jnp.where(big, 1e38, lr) * g, grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_local_copy_overflowed_by_a_finite_gradient_stops_the_run(mesh):
    """Device 3's gradient at step 2 is finite but its inner update overflows its copy; its
    next steps see non-finite gradients and are skipped; the sync after step 4 gets a
    non-finite outer gradient and is skipped (theta kept, the other devices keep their own
    copies: NumPy, four local SGD steps); the sync after step 8 finds device 3's streak (6)
    past max_consecutive_skips=2 and stops the run."""
    tx = jc.diloco(_overflowing_sgd(0.05), optax.sgd(0.7), 4, "dp", max_consecutive_skips=2)
    params, batches = make_params(), make_batches(8)
    batches[1][1][3 * B] = 1e8  # device 3, step 2: a finite gradient near 1e8
    step, initial = jc.make_train_step(mesh, "dp", loss_fn, tx, params)  # both runs below
    state = run_from(step, initial, batches[:4])
    assert int(state.opt_state.skips.total) == 1
    counts = np.asarray(state.opt_state.local.skips.total)
    np.testing.assert_array_equal(counts, [0, 0, 0, 2, 0, 0, 0, 0])
    _, xs = numpy_diloco(params, batches[:4], H=5, inner_lr=0.05, inner_mom=0.0, outer_lr=0.7,
                         outer_mom=0.0)  # fmt: skip
    for i, (got, theta) in enumerate(
        zip(
            jax.tree.leaves(state.params),
            jax.tree.leaves(state.opt_state.outer_params),
            strict=True,
        )
    ):
        np.testing.assert_array_equal(np.asarray(theta), jax.tree.leaves(params)[i])
        for r in (0, 1, 2, 4, 5, 6, 7):
            np.testing.assert_allclose(np.asarray(got)[r], xs[r][i], rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="consecutive steps"):
        jax.block_until_ready(run_from(step, initial, batches))


def test_bad_input_is_refused(mesh):
    inner, outer = optax.sgd(0.1), optax.sgd(0.7)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        jc.diloco(inner, outer, 0, "dp")
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        jc.diloco(inner, outer, 2.5, "dp")
    with pytest.raises(ValueError, match="fragments=5 > sync_every=4"):
        jc.diloco(inner, outer, 4, "dp", fragments=5)
    with pytest.raises(ValueError, match="overlap_steps=2 must be < sync_every / fragments"):
        jc.diloco(inner, outer, 8, "dp", fragments=4, overlap_steps=2)
    with pytest.raises(ValueError, match="overlap_steps must be an int >= 0"):
        jc.diloco(inner, outer, 8, "dp", overlap_steps=-1)
    with pytest.raises(ValueError, match="alpha must be in"):
        jc.diloco(inner, outer, 8, "dp", alpha=1.5)
    with pytest.raises(TypeError, match="the class OneBit"):
        jc.diloco(inner, outer, 8, "dp", compressor=jc.OneBit)
    with pytest.raises(TypeError, match="Compressor that all-reduces"):
        jc.diloco(inner, outer, 8, "dp", compressor="int8")
    with pytest.raises(TypeError, match="outer must be an optax GradientTransformation"):
        jc.diloco(inner, 0.7, 8, "dp")
    params = make_params()
    with pytest.raises(ValueError, match="fragments=3 but the parameters have only 2 leaves"):
        jc.diloco(inner, outer, 8, "dp", fragments=3, axis_size=N).init(params)
    with pytest.raises(TypeError, match="floating parameters only"):
        jc.diloco(inner, outer, 8, "dp", axis_size=N).init(
            {"w": params["w"], "n": jnp.ones(2, int)}
        )
    tx = jc.diloco(inner, outer, 8, "dp", axis_size=N)
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs the local parameters"):
        tx.update(params, state)
    with pytest.raises(ValueError, match="axis 'dp' is not bound"):
        tx.update(params, state, params)


def test_flax_nnx_example_equals_the_train_step(mesh):
    """examples/flax_nnx_diloco.py's NNX step (per-device model inside shard_map, jc.diloco in
    nnx.Optimizer) gives the outer parameters of jc.make_train_step on the same pure pytree."""
    import importlib.util
    import pathlib

    from flax import nnx

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "flax_nnx_diloco.py"
    spec = importlib.util.spec_from_file_location("jaxcomm_example_flax_nnx_diloco", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    vocab, steps = 12, 5
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.integers(0, vocab, (N * 2, example.CONTEXT)).astype(np.int32),
            rng.integers(0, vocab, (N * 2,)).astype(np.int32),
        )
        for _ in range(steps)
    ]
    tx = jc.diloco(
        optax.adam(1e-2),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        2,
        "dp",
        compressor=jc.Quantize(bits=8, error_feedback=True),
        axis_size=N,
    )
    model, _ = example.train(mesh, "dp", tx, batches, vocab, diloco=True, name="", log=None)

    graphdef, params = nnx.split(example.CharMLP(vocab, nnx.Rngs(0)), nnx.Param)

    def pure_loss(params, batch):
        return example.loss_fn(nnx.merge(graphdef, params), batch)

    step, state = jc.make_train_step(mesh, "dp", pure_loss, tx, jax.tree.map(np.asarray, params))
    for batch in batches:
        state, _ = step(state, batch)
    want = jc.diloco_params(state.opt_state)
    got = nnx.state(model, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_pmap_step_equals_the_shard_map_step(mesh):
    tx = make_tx(3, compressor=jc.Quantize(bits=8, error_feedback=True), fragments=2)
    params, batches = make_params(), make_batches(7)
    state = run(mesh, tx, params, batches)
    step, pstate = jc.make_pmap_train_step("dp", loss_fn, tx, params, devices=jax.devices()[:N])
    for batch in batches:
        pstate, _ = step(pstate, batch)
    for got, want in zip(
        jax.tree.leaves(jc.from_pmap_layout(pstate)), jax.tree.leaves(state), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_compressed_sync_sends_only_narrow_payloads(mesh):
    """From the compiled step: the int4 step's collectives are uint8/int8 codes plus small
    fp32 block scales (comms_report flags nothing wider than int8 over 4 KiB), about 7x fewer
    bytes than the exact step's fp32 all-reduce of the pseudo-gradients."""
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(64, 128)).astype(np.float32)}
    batch = (rng.normal(size=(N * B, 64)).astype(np.float32), np.zeros((N * B, 128), np.float32))

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    reports = {}
    for name, comp in (("exact", None), ("int4", jc.Quantize(bits=4, error_feedback=True))):
        tx = jc.diloco(optax.sgd(0.1), optax.sgd(0.7), 4, "dp", compressor=comp)
        # One program holding the sync step (a phase-specialised step reports its state's
        # phase only: here the first, an inner step that sends nothing but the loss).
        step, state = jc.make_train_step(mesh, "dp", loss, tx, params, specialize_phases=False)
        reports[name] = jc.comms_report(step, state, batch, expect="int8")
    assert not reports["exact"].ok  # the fp32 all-reduce of 8192 elements is flagged
    assert reports["int4"].ok, str(reports["int4"])
    ratio = reports["exact"].wire_bytes / reports["int4"].wire_bytes
    assert 6 < ratio < 8.1, ratio


@pytest.mark.parametrize("blocked", [False, True])
def test_inner_step_keeps_the_state_alike_by_cond_and_by_select(blocked):
    # The two ways a skipped inner step keeps its state (XLA:CPU's default and XLA:GPU's) give
    # the same values: the same arithmetic, which XLA may fuse differently (within a few fp32
    # roundings of the update), and the exact old state and a zero update on a NaN.
    from jaxcomm.optim.diloco.steps import make_inner_step

    rng = np.random.default_rng(0)
    inner = optax.adam(1e-2)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros((3,))}
    state = inner.init(params)
    state = inner.update(jax.tree.map(jnp.ones_like, params), state, params)[1]  # count 1
    if blocked:
        state = jax.tree.map(lambda x: jnp.reshape(x, (1, *jnp.shape(x))), state)
    finite = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    bad = {"w": finite["w"].at[1, 2].set(jnp.nan), "b": finite["b"]}

    def run(keep_by, grads):
        step = make_inner_step(inner, "i", keep_by)
        out = jax.vmap(
            lambda g, s, p: step(g, s, p, blocked),
            in_axes=(None, None, None),
            axis_name="i",
            axis_size=1,
        )(grads, state, params)
        return jax.tree.map(lambda x: np.asarray(x[0]), out)

    for grads, expect_ok in ((finite, True), (bad, False)):
        by_cond, by_select = run("cond", grads), run("select", grads)
        for a, b in zip(jax.tree.leaves(by_cond), jax.tree.leaves(by_select), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
        ok, updates, new_state = by_select
        assert bool(ok) is expect_ok
        if not expect_ok:  # skipped: zero update, the state as it was
            assert all(not np.any(u) for u in jax.tree.leaves(updates))
            for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True):
                np.testing.assert_array_equal(a, np.asarray(b))
    with pytest.raises(ValueError, match="keep_by"):
        make_inner_step(inner, "i", "where")


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_outer_step_writes_each_kept_output_in_one_pass_on_cpu(alpha, monkeypatch):
    # The outer step keeps theta, its outer state and the local copies where the merge is
    # finite. Computed from its own copy of the inputs, the new outer state fuses into its
    # select, as the new theta does into its own: XLA:CPU's cost analysis of the step, per
    # element of one leaf, is the probe (reads Delta, theta, m), theta (reads Delta, m, theta,
    # writes), m (reads Delta, m, writes) and the local copy (reads theta and x, writes): 15,
    # against 18 when the momentum is written once and read back by both. Same values either
    # way (to fp32 rounding), kept exactly on a NaN.
    from jaxcomm.guard import SkipCounters
    from jaxcomm.optim.diloco import steps

    n = 1 << 16
    rng = np.random.default_rng(0)
    delta, theta, local = ([jnp.asarray(rng.normal(size=n), jnp.float32)] for _ in range(3))
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    outer_state = outer.update(delta, outer.init(theta), theta)[1]  # a non-zero momentum

    def compiled():
        step = steps.make_outer_step(outer, alpha, None)
        fn = jax.jit(lambda d, th, st, x: step(d, th, st, x, SkipCounters.zeros()))
        return fn, fn.lower(delta, theta, outer_state, local).compile()

    fn, apart = compiled()
    moved = apart.cost_analysis()["bytes accessed"] / (4 * n)
    assert moved <= 15.01, moved
    monkeypatch.setattr(steps, "apart_on_cpu", lambda *v: v)
    shared_fn, shared = compiled()
    assert shared.cost_analysis()["bytes accessed"] / (4 * n) >= moved + 2
    # The same expressions, fused differently: equal to fp32 rounding.
    got, want = fn(delta, theta, outer_state, local), shared_fn(delta, theta, outer_state, local)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    kept = fn([delta[0].at[7].set(jnp.nan)], theta, outer_state, local)
    for a, b in zip(jax.tree.leaves(kept[:3]), jax.tree.leaves((theta, outer_state, local)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
