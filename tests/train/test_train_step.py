"""jc.make_train_step on the meshes and batches users have: JAX's default (Explicit-axis) mesh
and Auto ones, NumPy and jax.Array batches, and a loop that never reads a value."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES
LR = 1e-2


def regression(rows: int = 4 * N, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "b": jnp.zeros(3)}
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    y = rng.standard_normal((rows, 3)).astype(np.float32)
    return params, (x, y)


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def explicit_mesh():
    return jax.make_mesh((N,), ("dp",))  # JAX's default axis type (Explicit)


def auto_mesh():
    return jax.make_mesh((N,), ("dp",), axis_types=(AxisType.Auto,))


OPTIMIZERS = {
    "compressed_mean+adam": lambda: optax.chain(jc.compressed_mean("dp"), optax.adam(LR)),
    "onebit_adam": lambda: jc.onebit_adam(LR, freeze_step=2, axis_name="dp"),
    "zero_one_adam": lambda: jc.zero_one_adam(LR, axis_name="dp"),
    "onebit_lamb": lambda: jc.onebit_lamb(LR, freeze_step=2, axis_name="dp"),
    "sharded": lambda: jc.sharded(optax.adam(LR), "dp"),
    "diloco": lambda: jc.diloco(optax.adam(LR), optax.sgd(0.7, momentum=0.9), 2, "dp"),
}


def test_default_mesh_numpy_batch_is_exact_adam_on_the_global_batch():
    """Explicit mesh, NumPy batch, defaults: exactly Adam on the full-batch gradient (the
    reference is optax.adam on one device), to fp32 rounding over the steps."""
    params, batch = regression()
    tx = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(LR))
    step, state = jc.make_train_step(explicit_mesh(), "dp", loss_fn, tx, params)
    ref_tx = optax.adam(LR)
    ref_params, ref_state = params, ref_tx.init(params)
    steps = 5
    for _ in range(steps):
        state, loss = step(state, batch)
        grads = jax.grad(loss_fn)(ref_params, batch)
        updates, ref_state = ref_tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    got = jc.params_of(state)
    # Adam's step is ~lr per element; the mean over 8 devices rounds differently from the
    # full-batch mean by a few fp32 ulps of the gradient, amplified at most by lr / sqrt(v).
    for k in params:
        np.testing.assert_allclose(got[k], ref_params[k], rtol=0, atol=steps * LR * 1e-4)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_runs_on_both_mesh_kinds_with_any_batch(name):
    """The same parameters on an Explicit and an Auto mesh, whatever the batch is: NumPy, a
    single-device jax.Array, or already split over "dp"."""
    params, batch = regression()
    results = []
    for mesh in (auto_mesh(), explicit_mesh()):
        batches = [
            batch,
            jax.tree.map(jnp.asarray, batch),
            jax.device_put(batch, NamedSharding(mesh, P("dp"))),
        ]
        step, state = jc.make_train_step(mesh, "dp", loss_fn, OPTIMIZERS[name](), params)
        for b in batches:
            state, loss = step(state, b)
        assert np.isfinite(float(loss))
        results.append(jax.tree.map(np.asarray, jc.params_of(state)))
    for k in params:  # the same shard_map body on either mesh: identical programs' arithmetic
        np.testing.assert_allclose(results[1][k], results[0][k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make_mesh", [explicit_mesh, auto_mesh])
def test_a_batch_that_does_not_split_gets_one_sentence(make_mesh):
    params, (x, y) = regression(rows=4 * N)
    tx = optax.chain(jc.compressed_mean("dp"), optax.adam(LR))
    step, state = jc.make_train_step(make_mesh(), "dp", loss_fn, tx, params)
    with pytest.raises(ValueError, match=r"leading dimension 30.*multiple of 8"):
        step(state, (x[:30], y[:30]))
    with pytest.raises(ValueError, match=r"leading dimension 30.*multiple of 8"):
        step(state, (jnp.asarray(x[:30]), jnp.asarray(y[:30])))
    with pytest.raises(ValueError, match="scalar"):
        step(state, (x, np.float32(1.0)))


@pytest.mark.parametrize("make_mesh", [explicit_mesh, auto_mesh])
def test_an_optimizer_that_does_not_average_gets_one_sentence(make_mesh):
    """Plain optax.adam sees each device's own gradients: the parameters would drift apart.
    Refused at trace time with the fix named, on the first call and on ``step.lower``."""
    params, (x, y) = regression()
    step, state = jc.make_train_step(make_mesh(), "dp", loss_fn, optax.adam(LR), params)
    fix = r"differ across 'dp'.*jc\.compressed_mean\('dp', jc\.NoCompression\(\)\)"
    with pytest.raises(ValueError, match=fix):
        step(state, (x, y))
    with pytest.raises(ValueError, match=fix):
        step.lower(state, (x, y))


def test_pmap_step_refuses_a_batch_that_does_not_split():
    params, (x, y) = regression()
    tx = optax.chain(jc.compressed_mean("dp"), optax.adam(LR))
    step, state = jc.make_pmap_train_step("dp", loss_fn, tx, params)
    with pytest.raises(ValueError, match=r"\(30, 5\).*multiple of 8"):
        step(state, (x[:30], y[:30]))


@pytest.mark.parametrize("specialize_phases", [False, True])
def test_300_steps_without_reading_a_value(specialize_phases):
    """The README's loop, never reading the loss: the step bounds how far the host runs ahead
    (XLA:CPU aborts when collectives queue past its rendezvous timeout), and the result is
    still Adam on the global batch."""
    params, batch = regression()
    tx = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(1e-3))
    step, state = jc.make_train_step(
        explicit_mesh(), "dp", loss_fn, tx, params, specialize_phases=specialize_phases
    )
    ref = jax.jit(lambda p, s: _adam_step(p, s, batch))
    ref_params, ref_state = params, optax.adam(1e-3).init(params)
    outputs = []
    for _ in range(300):
        state, loss = step(state, batch)
        outputs.append(loss)
        # No more than max_in_flight steps may still be running when a call returns.
        if len(outputs) > step.max_in_flight:
            assert outputs[-step.max_in_flight - 1].is_ready()
        ref_params, ref_state = ref(ref_params, ref_state)
    for k in params:
        np.testing.assert_allclose(
            jc.params_of(state)[k], ref_params[k], rtol=0, atol=300 * 1e-3 * 1e-4
        )


def _adam_step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optax.adam(1e-3).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def test_max_in_flight_is_checked():
    params, _ = regression()
    tx = optax.chain(jc.compressed_mean("dp"), optax.adam(LR))
    with pytest.raises(ValueError, match="max_in_flight"):
        jc.make_train_step(auto_mesh(), "dp", loss_fn, tx, params, max_in_flight=0)


def test_phases_are_specialised_by_default():
    params, batch = regression()
    tx = jc.onebit_adam(LR, freeze_step=2, axis_name="dp")
    step, state = jc.make_train_step(explicit_mesh(), "dp", loss_fn, tx, params)
    assert step.phased is not None
    for _ in range(4):
        state, _ = step(state, batch)
    # warm-up, first compressed step, compressed steps in the step's space: three programs
    assert len(step.compiled_phases) == 3


def test_steady_phases_are_not_read_again():
    """1-bit Adam (freeze_step=3): the phases are read at the first step (warm-up, sure to hold
    for 2 more steps), at the first compressed step (moves the moments: holds for 0 steps) and
    once in the step's space (holds for good): 3 reads in 12 steps, and the same parameters as
    the single program."""
    params, batch = regression()
    make = lambda: jc.onebit_adam(LR, freeze_step=3, axis_name="dp")  # noqa: E731
    step, state = jc.make_train_step(explicit_mesh(), "dp", loss_fn, make(), params)
    single, s1 = jc.make_train_step(
        explicit_mesh(), "dp", loss_fn, make(), params, specialize_phases=False
    )
    reads = []
    probe = step.phased._probe
    step.phased._probe = lambda *a: reads.append(1) or probe(*a)
    for _ in range(12):
        state, _ = step(state, batch)
        s1, _ = single(s1, batch)
    assert len(reads) == 3
    for k in params:
        np.testing.assert_allclose(
            jc.params_of(state)[k], jc.params_of(s1)[k], rtol=1e-5, atol=12 * LR * 1e-5
        )
    # A state that is not the step's last output is read again.
    fresh = jax.tree.map(jnp.copy, state)
    state, _ = step(fresh, batch)
    assert len(reads) == 4
