"""jc.scale_by_zero_one_adam, 0/1 Adam's fp32 parameter change with the learning rate inside,
and jc.zero_one_adam, that change in the parameters' dtype: bit for bit on 8 devices of a
shard_map, through every kind of step (variance update, 1-bit momentum, local step,
synchronisation)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc
from tests.conftest import NUM_DEVICES
from tests.optim.shard_map_run import assert_bitwise_equal, run_updates

N = NUM_DEVICES
SHAPES = {"w": (6, 5), "b": (5,)}
STEPS = 10
# Variance updates at t = 1, 2, 4 (var_interval doubles after each), a 1-bit momentum step at
# t = 3, the freeze after t = 5 (a 1-bit step), then synchronisations and local steps as
# local_interval doubles to 4 (syncs at t = 6, 8; local steps at 7, 9, 10).
KW = dict(
    axis_name="dp",
    weight_decay=0.01,
    var_freeze_step=5,
    var_update_scaler=1,
    local_step_scaler=1,
    local_step_clipper=4,
)


def init_params(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}


def grad_steps(n=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(n)
    ]


def test_zero_one_adam_is_scale_by_zero_one_adam_in_the_parameters_dtype():
    lr = optax.linear_schedule(0.03, 0.01, STEPS)
    steps = grad_steps()
    want = run_updates(jc.zero_one_adam(lr, **KW), init_params(), steps, per_device_params=True)
    piece = jc.scale_by_zero_one_adam(lr, **KW)
    got = run_updates(piece, init_params(), steps, per_device_params=True)
    for t, (a, b) in enumerate(zip(want, got, strict=True)):
        assert_bitwise_equal(b, a, f"step {t}")
    _, params, state = want[-1]
    assert isinstance(state, jc.ZeroOneAdamState)
    assert int(state.count) == STEPS and int(state.local_interval) == 4
    # Local steps happened: the devices' parameters differ after step 10 (no sync there).
    assert not np.array_equal(params["w"][0], params["w"][1])


def test_bf16_parameters_get_the_fp32_change_cast_once():
    params = init_params(jnp.bfloat16)
    steps = grad_steps(1)
    alias = run_updates(jc.zero_one_adam(0.01, **KW), params, steps, per_device_params=True)
    piece = jc.scale_by_zero_one_adam(0.01, **KW)
    direct = run_updates(piece, params, steps, per_device_params=True)
    (u_a, _, s_a), (u_p, _, s_p) = alias[0], direct[0]
    assert all(u.dtype == jnp.bfloat16 for u in u_a.values())
    assert all(u.dtype == np.float32 for u in u_p.values())
    assert_bitwise_equal({k: u.astype(jnp.bfloat16) for k, u in u_p.items()}, u_a, "updates")
    assert_bitwise_equal(s_p, s_a, "state")


def test_kept_variance_means_are_the_means_of_nu_through_every_phase():
    """``state.nu_mean`` (what the damped denominators read in the steps that do not update
    ``nu``) equals each leaf's mean of ``nu`` after every step of a phase-specialised run: the
    variance updates, the 1-bit steps between them, the skipped variance update (a NaN
    gradient: both kept), the freeze, local steps and synchronisations."""
    import jax

    rng = np.random.default_rng(3)
    params = {"w": np.zeros((6, 5), np.float32), "b": np.zeros((5,), np.float32)}
    x = rng.normal(size=(4 * N, 6)).astype(np.float32)
    y = rng.normal(size=(4 * N, 5)).astype(np.float32)

    def loss_fn(p, batch):
        xb, yb = batch
        return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

    mesh = jax.make_mesh((N,), ("dp",))
    tx = jc.zero_one_adam(
        0.01, axis_name="dp", var_freeze_step=6, var_update_scaler=1,
        local_step_scaler=1, local_step_clipper=2,
    )  # fmt: skip
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    seen = set()
    for t in range(1, 13):
        bad = t == 4  # a variance update (t = 1, 2, 4 before the freeze), skipped
        batch = (np.full_like(x, np.nan) if bad else x, y)
        seen.add(tuple(step.phases(state, batch)))
        before = jax.tree.map(np.asarray, state.opt_state)  # the step donates its state
        state, _ = step(state, batch)
        opt = state.opt_state
        for k in params:
            nu = np.asarray(opt.nu[k])
            np.testing.assert_allclose(float(opt.nu_mean[k]), nu.mean(), rtol=1e-6, err_msg=k)
            if bad:
                np.testing.assert_array_equal(nu, before.nu[k])
                assert float(opt.nu_mean[k]) == float(before.nu_mean[k])
    assert int(state.opt_state.skips.total) == 1
    assert {(0,), (1,), (2,), (3,), (4,)} <= seen  # every kind of step ran


@pytest.mark.parametrize("kind", [1, 3], ids=["onebit-momentum", "sync"])
def test_compressed_steps_parameter_change_reads_only_what_it_needs(kind):
    """Preconditioned, the 1-bit momentum is ``m = mean * denom`` and its step ``lr * (m / c1)
    / denom`` is ``lr * mean / c1``; a synchronisation's parameter change, DeepSpeed's
    ``-lr*update - (u - lr*update) + avg / denom``, is ``avg / denom - u`` (the local step's
    terms cancel; ``avg / denom`` is the mean). Written so, the compiled change of one leaf
    (XLA:CPU cost analysis) reads the mean (and ``u``) and writes the change: 2 (3) arrays,
    where the written-out forms also read the variance (and the gradient and the momentum):
    3 (7). Equal to DeepSpeed's forms, in float64, up to fp32 rounding."""
    import jax

    from jaxcomm.optim._zero_one_step import ZeroOneStep

    n = 1 << 16
    rng = np.random.default_rng(0)
    g, mu, u, mean = (jnp.asarray(rng.normal(size=n), jnp.float32) for _ in range(4))
    nu = jnp.asarray(rng.uniform(0.5, 2.0, size=n), jnp.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    step = ZeroOneStep(
        b1=f32(0.9), b2=f32(0.999), b2_var=f32(0.999), eps=f32(1e-8), wd=f32(0.0),
        lr=f32(1e-3), t=jnp.int32(20), var_freeze_step=5, c1=f32(0.88), c2=f32(0.5),
        first_sync=False, floor=0.1, precondition=True, compress_momentum=True, params=None,
        axis_name="dp", compressor=jc.OneBit(), bucket_bytes=None, nu_means=None,
    )  # fmt: skip

    def change(g, mu, nu, u, mean):
        nu_mean = jnp.mean(nu)
        _, _, delta = step.apply_leaf(kind, True, g, mu, nu, nu_mean, u, mean, None, f32(4e-3))
        return delta

    compiled = jax.jit(change).lower(g, mu, nu, u, mean).compile()
    assert compiled.cost_analysis()["bytes accessed"] / (4 * n) <= {1: 2.01, 3: 3.01}[kind]
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    den = np.sqrt(as64(nu) / 0.5)
    den = np.maximum(den, 0.1 * np.sqrt(np.mean(as64(nu)) / 0.5)) + 1e-8
    avg = as64(mean) * den  # the mean in momentum space
    if kind == 1:
        want = -1e-3 * (avg / 0.88) / den
    else:
        local = 1e-3 * ((0.9 * as64(mu) + 0.1 * as64(g)) / 0.88) / den
        want = -local - (as64(u) - local) + avg / den
    np.testing.assert_allclose(np.asarray(compiled(g, mu, nu, u, mean)), want, rtol=1e-6, atol=1e-7)
