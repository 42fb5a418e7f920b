"""A TrainState checkpointed on 8 devices (orbax), resharded onto 4 and 3, trained on.

References: full-batch optax on one device for exact compressors (the mean gradient of the
global batch does not depend on the device count, so the whole 8 -> m run must equal it); for
1-bit compression, the pending sum of the error feedback (NumPy, from the OneBit layout) is
preserved and the loss continues within the compression noise of the uninterrupted run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm as jc
from tests.conftest import make_mesh

BATCH = 24  # divisible by 8, 4 and 3
BEFORE, AFTER = 6, 6


def loss_fn(params, batch):
    x, y = batch
    hidden = jnp.tanh(x @ params["w1"] + params["b"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def init_params():
    rng = np.random.default_rng(1)
    return {
        "w1": rng.normal(size=(6, 5)).astype(np.float32),
        "b": np.zeros((1,), np.float32),  # one element: padding rows in every shard layout
        "w2": rng.normal(size=(5, 3)).astype(np.float32) * 0.5,
    }


def batches(count, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    out = []
    for _ in range(count):
        x = rng.normal(size=(BATCH, 6)).astype(np.float32)
        out.append((x, np.tanh(x @ w) + 0.1 * rng.normal(size=(BATCH, 3)).astype(np.float32)))
    return out


def checkpoint_and_restore(tmp_path, state, tx, params, n):
    """Save with orbax (sharded on n devices), restore onto one device as a new process would."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    target = jc.train_state_template(
        tx,
        params,
        axis_name="dp",
        axis_size=n,
        sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]),
    )
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    checkpointer.close()
    return restored


def run(mesh, tx, params, data, state=None):
    step, init = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    state = init if state is None else state
    losses = []
    for batch in data:
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def reference_run(inner, params, data):
    """Plain optax on the global batch, one device: the exact-compressor reference."""
    opt = inner.init(params)
    params = jax.tree.map(jnp.asarray, params)

    @jax.jit
    def step(params, opt, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt = inner.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    for batch in data:
        params, opt = step(params, opt, batch)
    return params


EXACT = {
    "compressed_mean_adam": lambda: optax.chain(
        jc.compressed_mean("dp", jc.NoCompression()), optax.adam(0.02)
    ),
    "sharded_adamw": lambda: jc.sharded(optax.adamw(0.02, weight_decay=0.1), "dp"),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_resharded_run_equals_full_batch_optax(tmp_path, name):
    params = init_params()
    data = batches(BEFORE + AFTER)
    tx = EXACT[name]()
    inner = (
        optax.adam(0.02) if name == "compressed_mean_adam" else optax.adamw(0.02, weight_decay=0.1)
    )
    expected = reference_run(inner, params, data)
    state, _ = run(make_mesh(8), tx, params, data[:BEFORE])
    restored = checkpoint_and_restore(tmp_path, state, tx, params, 8)
    for m in (4, 3):
        mesh = make_mesh(m)
        resharded = jc.reshard_train_state(
            restored, tx, params, axis_name="dp", new_axis_size=m, mesh=mesh
        )
        for leaf in jax.tree.leaves(resharded):
            assert leaf.sharding.mesh == mesh
        final, _ = run(mesh, tx, params, data[BEFORE:], resharded)
        for key in params:
            np.testing.assert_allclose(
                np.asarray(final.params[key]),
                np.asarray(expected[key]),
                rtol=2e-5,
                atol=2e-6,
                err_msg=f"{name} 8 -> {m}, {key}",
            )


def test_sharded_state_is_resliced_to_full_batch_moments(tmp_path):
    """The re-sliced Adam moments of jc.sharded, joined again, are full-batch optax's moments."""
    params = init_params()
    data = batches(BEFORE)
    tx = jc.sharded(optax.adam(0.02), "dp")
    state, _ = run(make_mesh(8), tx, params, data)
    opt = optax.adam(0.02).init(params)
    p = jax.tree.map(jnp.asarray, params)
    for batch in data:
        updates, opt = optax.adam(0.02).update(jax.grad(loss_fn)(p, batch), opt, p)
        p = optax.apply_updates(p, updates)
    for m in (3, 5):
        out = jc.reshard_train_state(state, tx, params, axis_name="dp", new_axis_size=m)
        inner = out.opt_state.inner[0]  # ScaleByAdamState of the m devices' shards
        np.testing.assert_array_equal(inner.count, np.full((m,), BEFORE))
        for key, x in params.items():
            c = -(-x.size // m)
            for got, want in ((inner.mu[key], opt[0].mu[key]), (inner.nu[key], opt[0].nu[key])):
                assert got.shape == (m, c)
                flat = got.reshape(-1)
                np.testing.assert_allclose(flat[: x.size], np.ravel(want), rtol=1e-5, atol=1e-8)
                np.testing.assert_array_equal(flat[x.size :], 0)  # padding stays zero


def onebit_pending_sum(comm, n):
    """NumPy model of OneBit's pending sum, one bucket: sum_r w_r[:N] + n * concat_r s_r[:N]."""
    (bucket,) = comm.buckets
    size = sum(x.size for x in init_params().values())
    worker = np.asarray(bucket.worker_error, np.float64)
    server = np.asarray(bucket.server_error, np.float64).reshape(-1)
    assert worker.shape[0] == n
    return worker[:, :size].sum(axis=0) + n * server[:size]


def test_onebit_adam_error_feedback_keeps_pending_sum_and_loss_continues(tmp_path):
    params = init_params()
    before, after = 8, 12
    data = batches(before + after)
    tx = jc.onebit_adam(0.01, freeze_step=4, axis_name="dp")
    exact_tx = jc.onebit_adam(0.01, freeze_step=4, axis_name="dp", compressor=jc.NoCompression())
    state, _ = run(make_mesh(8), tx, params, data[:before])
    restored = checkpoint_and_restore(tmp_path, state, tx, params, 8)
    pending = onebit_pending_sum(restored.opt_state.comm, 8)
    assert np.abs(pending).max() > 1e-3  # mid compression stage: there is something to keep
    _, uninterrupted = run(make_mesh(8), tx, params, data[before:], state)
    _, exact = run(make_mesh(8), exact_tx, params, data)
    exact = np.asarray(exact[before:])
    noise_8 = np.abs(np.asarray(uninterrupted) - exact).mean()
    for m in (4, 3):
        mesh = make_mesh(m)
        resharded = jc.reshard_train_state(
            restored, tx, params, axis_name="dp", new_axis_size=m, compressor=jc.OneBit(),
            mesh=mesh,
        )  # fmt: skip
        # The pending contribution to the *mean* (sum / devices) carries over.
        np.testing.assert_allclose(
            onebit_pending_sum(resharded.opt_state.comm, m) / m, pending / 8, rtol=1e-5, atol=1e-7
        )
        for key in ("mu", "nu"):  # replicated moments kept bit for bit
            for got, want in zip(
                jax.tree.leaves(getattr(resharded.opt_state, key)),
                jax.tree.leaves(getattr(restored.opt_state, key)),
                strict=True,
            ):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        _, losses = run(mesh, tx, params, data[before:], resharded)
        # A run that had m devices all along: the resumed one continues within its noise.
        _, on_m = run(mesh, tx, params, data)
        on_m = np.asarray(on_m[before:])
        noise_m = np.abs(on_m - exact).mean()  # 1-bit vs exact on the same steps
        gap_m = np.abs(np.asarray(losses) - on_m).mean()
        gap_8 = np.abs(np.asarray(losses) - np.asarray(uninterrupted)).mean()
        print(f"8 -> {m}: |resumed - on {m}| {gap_m:.4f}, |resumed - on 8| {gap_8:.4f}, noise "
              f"{noise_m:.4f} (on {m}), {noise_8:.4f} (on 8)")  # fmt: skip
        assert gap_m <= 1.5 * noise_m, (gap_m, noise_m)  # keeping T itself: 6x the noise
        assert gap_8 <= 2 * max(noise_m, noise_8), (gap_8, noise_m, noise_8)


def test_zero_one_adam_local_state_and_params_are_averaged():
    params = init_params()
    data = batches(5)
    tx = jc.zero_one_adam(
        0.02, var_freeze_step=2, local_step_scaler=1, local_step_clipper=4, axis_name="dp"
    )
    state, _ = run(make_mesh(8), tx, params, data)  # between synchronisations
    old_u = np.asarray(state.opt_state.local.u["w1"])
    assert not np.allclose(old_u[0], old_u[1])  # the devices really differ
    out = jc.reshard_train_state(
        state, tx, params, axis_name="dp", new_axis_size=3, compressor=jc.OneBit()
    )
    for got, old in (
        (out.params["w1"], state.params["w1"]),
        (out.opt_state.local.mu["w2"], state.opt_state.local.mu["w2"]),
        (out.opt_state.local.u["w1"], state.opt_state.local.u["w1"]),
    ):
        old = np.asarray(old, np.float64)
        assert got.shape == (3, *old.shape[1:])
        for r in range(3):
            np.testing.assert_allclose(got[r], old.mean(axis=0), rtol=1e-6, atol=1e-7)
    assert int(out.opt_state.count) == 5
    # Continues on 3 devices.
    mesh = make_mesh(3)
    placed = jc.reshard_train_state(
        state, tx, params, axis_name="dp", new_axis_size=3, compressor=jc.OneBit(), mesh=mesh
    )
    _, losses = run(mesh, tx, params, batches(3, seed=5), placed)
    assert np.all(np.isfinite(losses))


def test_bad_input_is_refused():
    params = init_params()
    tx = jc.onebit_adam(0.02, freeze_step=2, axis_name="dp")
    state, _ = run(make_mesh(8), tx, params, batches(3))
    with pytest.raises(ValueError, match="pass compressor="):
        jc.reshard_train_state(state, tx, params, axis_name="dp", new_axis_size=4)
    with pytest.raises(ValueError, match="does not fit compressor"):
        jc.reshard_train_state(
            state,
            tx,
            params,
            axis_name="dp",
            new_axis_size=4,
            compressor=jc.OneBit(),
            bucket_bytes=64,
        )
    with pytest.raises(ValueError, match="new_axis_size must be a positive int"):
        jc.reshard_train_state(state, tx, params, axis_name="dp", new_axis_size=0)
    other = jc.compressed_mean("dp", jc.OneBit())
    with pytest.raises(ValueError, match="structure does not match"):
        jc.reshard_train_state(state, other, params, axis_name="dp", new_axis_size=4)
    with pytest.raises(ValueError, match="expected"):
        jc.reshard_train_state(
            state,
            tx,
            params,
            axis_name="dp",
            new_axis_size=4,
            axis_size=4,
            compressor=jc.OneBit(),
        )


def test_sharded_int8_with_master_shards_continues_on_3(tmp_path):
    """qgZ error feedback (ScatterState inside ShardedState) and qwZ master shards, 8 -> 3."""
    params = init_params()
    data = batches(BEFORE + AFTER)
    qgz = jc.Quantize(bits=8, error_feedback=True)
    tx = jc.sharded(optax.adam(0.02), "dp", compressor=qgz, gather_compressor=jc.Quantize(bits=8))
    state, _ = run(make_mesh(8), tx, params, data[:BEFORE])
    restored = checkpoint_and_restore(tmp_path, state, tx, params, 8)
    mesh = make_mesh(3)
    out = jc.reshard_train_state(
        restored, tx, params, axis_name="dp", new_axis_size=3, compressor=qgz, mesh=mesh
    )
    for key, x in params.items():  # the exact master copy, re-sliced
        old = np.asarray(restored.opt_state.master.shards[key]).reshape(-1)[: x.size]
        new = np.asarray(out.opt_state.master.shards[key])
        assert new.shape == (3, -(-x.size // 3))
        np.testing.assert_array_equal(new.reshape(-1)[: x.size], old)
    final, _ = run(mesh, tx, params, data[BEFORE:], out)
    expected = reference_run(optax.adam(0.02), params, data)
    for key in params:  # int8 both ways: close to exact Adam, relative to the distance moved
        got, want = np.asarray(final.params[key]), np.asarray(expected[key])
        moved = np.linalg.norm(want - params[key])
        assert np.linalg.norm(got - want) <= 0.05 * moved, (key, np.linalg.norm(got - want), moved)


def test_diloco_state_is_resharded_through_its_own_resize():
    params = init_params()
    qz = jc.Quantize(bits=8, error_feedback=True)
    tx = jc.diloco(optax.adam(0.02), optax.sgd(0.7, momentum=0.9), 2, "dp", compressor=qz)
    state, _ = run(make_mesh(8), tx, params, batches(3))  # mid-interval: local copies differ
    old = np.asarray(state.params["w1"], np.float64)
    assert not np.allclose(old[0], old[1])
    mesh = make_mesh(3)
    out = jc.reshard_train_state(
        state, tx, params, axis_name="dp", new_axis_size=3, compressor=qz, mesh=mesh
    )
    got = np.asarray(out.params["w1"])
    assert got.shape == (3, *old.shape[1:])
    for r in range(3):
        np.testing.assert_allclose(got[r], old.mean(axis=0), rtol=1e-6, atol=1e-7)
    _, losses = run(mesh, tx, params, batches(4, seed=7), out)
    assert np.all(np.isfinite(losses))
