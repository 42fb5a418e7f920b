"""Orbax checkpoints of a data-parallel run resume it bit for bit, error feedback included."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm as jc

N = 8


def loss_fn(params, batch):
    x, y = batch
    hidden = jnp.tanh(x @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def batches(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(2 * N, 6)).astype(np.float32),
            rng.normal(size=(2 * N, 2)).astype(np.float32),
        )
        for _ in range(count)
    ]


def host(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    "tx",
    [
        pytest.param(
            optax.inject_hyperparams(jc.onebit_adam)(
                learning_rate=0.01, freeze_step=2, axis_name="dp"
            ),
            id="onebit_adam",
        ),
        pytest.param(
            jc.zero_one_adam(
                0.01, var_freeze_step=2, local_step_scaler=1, local_step_clipper=4, axis_name="dp"
            ),
            id="zero_one_adam",
        ),
        pytest.param(
            jc.onebit_lamb(0.01, freeze_step=2, weight_decay=0.01, axis_name="dp"),
            id="onebit_lamb",
        ),
        pytest.param(
            optax.chain(jc.compressed_mean("dp", warmup_steps=1), optax.adam(0.01)),
            id="compressed_mean",
        ),
    ],
)
def test_resume_from_checkpoint_is_bit_exact(mesh, tmp_path, tx):
    rng = np.random.default_rng(1)
    params = {
        "w1": rng.normal(size=(6, 5)).astype(np.float32),
        "w2": rng.normal(size=(5, 2)).astype(np.float32),
    }
    data = batches(8)
    before, after = data[:5], data[5:]  # 0/1 Adam: saved between syncs (steps 5 | 6, 7, 8)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    for batch in before:
        state, _ = step(state, batch)

    # Mid compression stage: the per-device error feedback is non-zero and differs by device.
    errors = [e for e in host(state.opt_state) if e.ndim >= 2 and e.shape[0] == N]
    assert errors and any(np.abs(e).max() > 0 and not np.allclose(e[0], e[1]) for e in errors)
    if isinstance(state.opt_state, jc.ZeroOneAdamState):  # local updates not yet synchronised
        assert np.abs(np.asarray(state.opt_state.local.u["w1"])).max() > 0

    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    saved = host(state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()

    for batch in after:  # the uninterrupted run
        state, _ = step(state, batch)
    expected = host(state)

    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    checkpointer.close()
    assert jax.tree.structure(restored) == jax.tree.structure(abstract)
    for got, want in zip(host(restored), saved, strict=True):
        np.testing.assert_array_equal(got, want)
    for leaf, spec in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
        assert leaf.sharding == spec.sharding
    for batch in after:
        restored, _ = step(restored, batch)
    for got, want in zip(host(restored), expected, strict=True):
        np.testing.assert_array_equal(got, want)
