"""1-bit Adam reading its momentum from the packed 1-bit mean (``state.mean_wire``).

After the first compressed step 1-bit Adam keeps its momentum twice: dense (``mu``) and as the
1-bit all-reduce sent it (``mean_wire``, 1/32 of the bytes), and in programs lowered for a GPU
its compressed steps read the packed one. References: the NumPy model of the optimizer
(tests/reference/adam_reference.py) for the default rules without a momentum mask (the packed
path), the invariant ``mu == decode(mean_wire)`` after every compressed step, and the same
optimizer on its dense path (a momentum mask of ones: no packed mean) for skipped steps and a
reshard onto fewer devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc
from jaxcomm import fusion
from jaxcomm.comm.packed import unpack_mean
from tests.conftest import make_mesh
from tests.optim.test_optimizers import (
    SHAPES,
    SIZES,
    N,
    flat,
    flat_per_device,
    grad_steps,
    init_params,
    linear_loss,
)
from tests.reference.adam_reference import OnebitAdamModel

FREEZE, STEPS = 3, 9


def decoded_momentum(opt, params, bucket_bytes):
    local = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
    return jax.jit(lambda w: unpack_mean(w, local, jc.OneBit(), bucket_bytes))(opt.mean_wire)


@pytest.mark.parametrize(
    "bucket_bytes,phased,gpu_forms",
    [(None, True, True), (1, True, True), (None, True, False), (None, False, False)],
    ids=["one-bucket", "bucket-per-leaf", "one-bucket-cpu-forms", "one-program"],
)  # fmt: skip
def test_default_rules_on_the_packed_path_match_the_model(
    bucket_bytes, phased, gpu_forms, monkeypatch
):
    """jaxcomm's default rules with no momentum mask: the phase-specialised compressed steps
    keep the packed mean, read the previous momentum from it in the programs lowered for a GPU
    (forced here on CPU) and from ``mu`` elsewhere, and the run is the model's. One program for
    every phase (the compressed step's kind traced) keeps no packed mean and reads ``mu``."""
    if gpu_forms:
        monkeypatch.setattr(fusion, "_on_gpu_else", lambda *ops, gpu, other: gpu(*ops))
    lr = optax.linear_schedule(0.02, 0.005, STEPS)
    tx = jc.onebit_adam(
        lr, axis_name="dp", freeze_step=FREEZE, weight_decay=0.01, bucket_bytes=bucket_bytes
    )
    model = OnebitAdamModel(
        N, flat(init_params()), lr=lr, weight_decay=0.01, freeze_step=FREEZE,
        bucket_sizes=SIZES if bucket_bytes == 1 else None, bias_correction=True,
        variance_floor=0.1, leaf_sizes=SIZES, precondition=True,
    )  # fmt: skip
    mesh = make_mesh(N)
    step, state = jc.make_train_step(
        mesh, "dp", linear_loss, tx, init_params(), specialize_phases=phased
    )
    assert state.opt_state.mean_wire.buckets, "OneBit on one axis keeps a packed mean"
    for k, grads in enumerate(grad_steps(STEPS)):
        state, _ = step(state, grads)
        expected = model.step(flat_per_device(grads))
        np.testing.assert_allclose(flat(state.params), expected, rtol=1e-4, atol=1e-5, err_msg=k)
        opt = state.opt_state
        assert bool(opt.mean_wire.valid) == (phased and k >= FREEZE)
        if phased and k >= FREEZE:  # the packed mean is the dense momentum, bit for bit
            mu = decoded_momentum(opt, init_params(), bucket_bytes)
            for name in SHAPES:
                np.testing.assert_array_equal(np.asarray(mu[name]), np.asarray(opt.mu[name]))
    np.testing.assert_allclose(flat(opt.mu) * flat(opt.nu), model.m, rtol=1e-4, atol=1e-7)
    if phased:
        assert set(step.compiled_phases) == {(0,), (1,), (2,)}


def dense_twin(**kw):
    """The same optimizer on its dense path: a momentum mask of ones changes no value and
    keeps no packed mean."""
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    return jc.onebit_adam(1e-2, axis_name="dp", momentum_mask=ones, **kw)


def assert_trees_close(got, want, err_msg=""):
    for name in SHAPES:
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), rtol=1e-6, atol=1e-7, err_msg=err_msg
        )


@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["one-bucket", "bucket-per-leaf"])
def test_a_skipped_compressed_step_keeps_the_packed_mean(bucket_bytes):
    """A NaN gradient after the freeze: nothing moves, the packed mean stays valid and
    unchanged, and the run goes on as the dense path's."""
    kw = dict(freeze_step=FREEZE, bucket_bytes=bucket_bytes)
    mesh = make_mesh(N)
    packed_step, packed = jc.make_train_step(
        mesh, "dp", linear_loss, jc.onebit_adam(1e-2, axis_name="dp", **kw), init_params()
    )
    dense_step, dense = jc.make_train_step(mesh, "dp", linear_loss, dense_twin(**kw), init_params())
    assert dense.opt_state.mean_wire.buckets == ()
    steps = grad_steps(8, seed=4)
    steps[5]["b"][2, 4] = np.nan
    for k, grads in enumerate(steps):
        before = jax.tree.map(np.asarray, packed.opt_state.mean_wire)
        packed, _ = packed_step(packed, grads)
        dense, _ = dense_step(dense, grads)
        assert_trees_close(packed.params, dense.params, err_msg=f"step {k}")
        if k == 5:
            after = jax.tree.map(np.asarray, packed.opt_state.mean_wire)
            for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
                np.testing.assert_array_equal(x, y)
            assert int(packed.opt_state.skips.total) == 1
    assert bool(packed.opt_state.mean_wire.valid)


def test_reshard_resets_the_packed_mean_and_the_run_goes_on():
    """Onto 4 devices: the packed mean (laid out for 8) is reset, not valid; the next step reads
    the dense momentum, sends a mean for 4 devices, and the run is the dense path's."""
    kw = dict(freeze_step=2)
    tx = jc.onebit_adam(1e-2, axis_name="dp", **kw)
    twin = dense_twin(**kw)
    params = init_params()
    mesh = make_mesh(N)
    states = {}
    for name, opt in (("packed", tx), ("dense", twin)):
        step, state = jc.make_train_step(mesh, "dp", linear_loss, opt, params)
        for grads in grad_steps(5, seed=6):
            state, _ = step(state, grads)
        states[name] = state
    assert bool(states["packed"].opt_state.mean_wire.valid)
    small = make_mesh(4)
    after = {}
    for name, opt in (("packed", tx), ("dense", twin)):
        moved = jc.reshard_train_state(
            states[name], opt, params, axis_name="dp", new_axis_size=4,
            compressor=jc.OneBit(), mesh=small,
        )  # fmt: skip
        if name == "packed":
            wire = moved.opt_state.mean_wire
            assert not bool(wire.valid)
            fresh = jc.train_state_template(opt, params, axis_name="dp", axis_size=4)
            want = jax.tree.map(lambda t: t.shape, fresh.opt_state.mean_wire)
            assert jax.tree.map(np.shape, wire) == want
        step, _ = jc.make_train_step(small, "dp", linear_loss, opt, params)
        for grads in grad_steps(3, seed=7):
            quarter = {k: v[:4] for k, v in grads.items()}
            moved, _ = step(moved, quarter)
        after[name] = moved
    assert bool(after["packed"].opt_state.mean_wire.valid)
    assert_trees_close(after["packed"].params, after["dense"].params)
    assert_trees_close(after["packed"].opt_state.mu, after["dense"].opt_state.mu)
