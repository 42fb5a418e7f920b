"""Data-parallel train steps (shard_map and pmap) and the state layout helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.inspect.hlo import collectives_in_hlo, wire_bytes
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES
D = 24  # features


def regression(seed=0, batch=4 * N):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, D)).astype(np.float32)
    w = rng.normal(size=(D,)).astype(np.float32)
    y = (x @ w + 0.3).astype(np.float32)
    params = {"w": np.zeros((D,), np.float32), "b": np.zeros((), np.float32)}
    return params, (x, y)


def mse(params, batch):
    x, y = batch
    err = x @ params["w"] + params["b"] - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def loss_only(params, batch):
    return mse(params, batch)[0]


def test_exact_data_parallel_is_full_batch_gradient_descent(mesh):
    params, (x, y) = regression()
    tx = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.sgd(0.05))
    step, state = jc.make_train_step(mesh, "dp", mse, tx, params, has_aux=True)
    # Layout: params replicated, no per-device leaves for an exact compressor.
    assert state.params["w"].sharding.is_fully_replicated
    w, b = params["w"].astype(np.float64), 0.0
    for _ in range(5):
        err = x @ w + b - y
        loss = np.mean(err**2)
        w, b = w - 0.05 * 2 * x.T @ err / len(y), b - 0.05 * 2 * err.mean()
        state, (got_loss, aux) = step(state, (x, y))
        np.testing.assert_allclose(float(got_loss), loss, rtol=1e-5)
        assert aux["mae"].shape == ()
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["b"], b, rtol=1e-5, atol=1e-6)
    # The caller's arrays were copied, not donated.
    assert np.all(params["w"] == 0)


def test_state_layout_and_specs(mesh):
    params, batch = regression()
    tx = optax.inject_hyperparams(jc.onebit_adam, static_args=("freeze_step",))(
        learning_rate=0.01, freeze_step=100, axis_name="dp"
    )
    step, state = jc.make_train_step(mesh, "dp", loss_only, tx, params)
    specs = jc.train_state_specs(state, "dp")
    assert jax.tree.leaves(specs.params) == [P(), P()]
    inner = specs.opt_state.inner_state
    assert inner.count == P() and inner.mu["w"] == P() and inner.nu["b"] == P()
    assert specs.opt_state.hyperparams["learning_rate"] == P()
    comm_specs = jax.tree.leaves(inner.comm, is_leaf=lambda s: isinstance(s, P))
    comm_arrays = jax.tree.leaves(state.opt_state.inner_state.comm)
    assert comm_specs and all(s == P("dp") for s in comm_specs)
    # Per-device leaves: (n, *local) with row r on device r.
    for leaf in comm_arrays:
        assert leaf.shape[0] == N and leaf.sharding.spec == P("dp")
    # 0/1 Adam: parameters and the LocalState are per device too.
    tx01 = jc.zero_one_adam(0.01, axis_name="dp")
    _, state01 = jc.make_train_step(mesh, "dp", loss_only, tx01, params)
    specs01 = jc.train_state_specs(state01, "dp")
    assert specs01.params["w"] == P("dp") and state01.params["w"].shape == (N, D)
    assert specs01.opt_state.local.mu["w"] == P("dp") and specs01.opt_state.nu["w"] == P()
    assert specs01.opt_state.lrs == P()
    np.testing.assert_array_equal(jc.params_of(state01)["w"], params["w"])
    # Layout round trip through the pmap layout.
    stacked = jc.to_pmap_layout(state01, N)
    assert stacked.opt_state.count.shape == (N,) and stacked.params["w"].shape == (N, D)
    back = jc.from_pmap_layout(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(state01)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state01), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_pmap_step_matches_shard_map_step(mesh, which):
    params, batch = regression(seed=1)
    if which == "onebit_adam":
        tx = jc.onebit_adam(0.05, freeze_step=2, weight_decay=0.01, axis_name="dp")
    else:
        tx = jc.zero_one_adam(
            0.05, var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, axis_name="dp"
        )
    step, state = jc.make_train_step(mesh, "dp", loss_only, tx, params)
    pstep, pstate = jc.make_pmap_train_step("dp", loss_only, tx, params)
    # The same algorithm, not the same program: under shard_map the error feedback stays in
    # (1, *local) blocks (updated in place), under pmap it is (*local), so XLA may sum the 1-bit
    # scales' norms in another order. The bound is fp32 rounding over the steps taken.
    steps = 6
    rtol = steps * 10 * np.finfo(np.float32).eps
    for _ in range(steps):
        state, loss = step(state, batch)
        pstate, ploss = pstep(pstate, batch)
        np.testing.assert_allclose(float(ploss), float(loss), rtol=rtol)
    got = jc.from_pmap_layout(pstate)
    assert jax.tree.structure(got) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if not np.issubdtype(b.dtype, np.floating):
            np.testing.assert_array_equal(a, b)
            continue
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b)) + 1e-30))


def test_no_hidden_gradient_all_reduce(mesh):
    """Gradients of replicated params would be psum'd by JAX; the step avoids that: only the
    1-bit payload (and the scalar loss) crosses the wire."""
    params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}
    batch = (jnp.ones((2 * N, 64)), jnp.ones((2 * N, 64)))

    def loss(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def compiled(tx):
        step, state = jc.make_train_step(mesh, "dp", loss, tx, params)
        return step.lower(state, batch).compile().as_text()

    onebit = compiled(optax.chain(jc.compressed_mean("dp"), optax.sgd(0.1)))
    exact = compiled(optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.sgd(0.1)))
    reduces = [o for o in collectives_in_hlo(onebit) if o.op == "all-reduce"]
    assert all(o.payload_bytes <= 4 for o in reduces), [o.line for o in reduces]
    assert wire_bytes(exact) > 25 * wire_bytes(onebit)


def test_device_varying_updates_are_refused(mesh):
    """A transformation that does not communicate would let replicas diverge: check_vma finds it
    at trace time and the step says so in one sentence."""
    params, batch = regression()
    step, state = jc.make_train_step(mesh, "dp", loss_only, optax.sgd(0.1), params)
    with pytest.raises(ValueError, match="differ across 'dp' .it does not average the gradients"):
        step(state, batch)


def test_state_partition_specs_refuses_an_nnx_state():
    """nnx.split drops the optax NamedTuple types: every leaf would silently look replicated."""
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = jc.onebit_adam(1e-3, freeze_step=100, axis_name="dp", axis_size=8)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    _, state = nnx.split(optimizer)
    with pytest.raises(TypeError, match="nnx State"):
        jc.state_partition_specs(state, "dp")
    # On the objects themselves the 1-bit error feedback is found and placed on the axis.
    specs = jax.tree.leaves(
        nnx.state(jc.state_partition_specs(optimizer, "dp")), is_leaf=lambda x: isinstance(x, P)
    )
    assert P("dp") in specs and P() in specs
