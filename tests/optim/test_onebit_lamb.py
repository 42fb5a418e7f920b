"""jc.onebit_lamb against a NumPy model of DeepSpeed's OnebitLamb
(tests/reference/lamb_reference.py).

8 simulated devices. As in test_optimizers.py, the per-device gradients are the batch of a
linear "loss" ``sum(p * g)``, so the whole data-parallel path (``jc.make_train_step``: local
grads -> transformation -> params) is what is compared. The parameter leaves have very
different norms and the gradient scale changes after the switch, so that every clip of the
trust ratio and of the correction factor fires at least once (checked on the model's record).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES
from tests.optim.shard_map_run import assert_bitwise_equal, run_updates
from tests.reference.lamb_reference import OnebitLambModel

N = NUM_DEVICES
SHAPES = {"a": (3, 7), "b": (11,), "c": (4, 4), "d": (5,)}  # 53 elements, padded to 64
# Trust ratios above max, below min, in between; "d" starts at 0 (||p|| = 0: coefficient 1).
SCALES = {"a": 30.0, "b": 0.01, "c": 1.0, "d": 0.0}
KEYS = sorted(SHAPES)
FREEZE = 3
# Gradient scale per step: small after the switch (the fresh variance falls, the factor rises),
# then large (it falls).
GRAD_SCALE = [1, 1, 1, 0.05, 0.05, 0.05, 3, 3, 3, 3]


def linear_loss(params, batch):
    return sum(jnp.sum(params[k] * batch[k][0].astype(params[k].dtype)) for k in params)


def init_params(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {k: (SCALES[k] * rng.normal(size=s)).astype(dtype) for k, s in SHAPES.items()}


def grad_steps(scales, seed=5):
    rng = np.random.default_rng(seed)
    out = []
    for scale in scales:
        common = {k: rng.normal(size=s) for k, s in SHAPES.items()}
        out.append(
            {
                k: (scale * (common[k][None] + 0.5 * rng.normal(size=(N, *s)))).astype(np.float32)
                for k, s in SHAPES.items()
            }
        )
    return out


def flat(tree):
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(-1) for k in KEYS])


def flat_per_device(tree):
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(N, -1) for k in KEYS], axis=1)


def per_leaf(tree):
    return np.array([float(tree[k]) for k in KEYS])


def run(tx, steps, params=None, *, pmap=False):
    params = init_params() if params is None else params
    if pmap:
        step, state = jc.make_pmap_train_step("dp", linear_loss, tx, params)
    else:
        mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
        step, state = jc.make_train_step(mesh, "dp", linear_loss, tx, params)
    history = []
    for grads in steps:
        state, _ = step(state, grads)
        history.append(jax.tree.map(np.asarray, jc.params_of(state, pmap=pmap)))
    return history, state


CASES = {
    # Trust-ratio clips, weight decay, the factor's threshold both ways; one flat buffer.
    "coeff_clips_threshold": (
        dict(b2=0.5, weight_decay=0.01, max_coeff=15.0, min_coeff=0.05),
        None,
        {"coeff_max", "coeff_min", "coeff_one", "threshold_up", "threshold_down"},
    ),
    # The factor's absolute clips (loose threshold); one bucket per leaf.
    "factor_clips_per_leaf_buckets": (
        dict(b2=0.5, max_coeff=15.0, min_coeff=0.05, factor_threshold=10.0, factor_max=1.5,
             factor_min=0.99),
        1,
        {"coeff_max", "coeff_min", "factor_max", "factor_min"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_onebit_lamb_matches_deepspeed_model(case):
    kw, bucket_bytes, events = CASES[case]
    lr = optax.linear_schedule(0.02, 0.01, len(GRAD_SCALE))
    steps = grad_steps(GRAD_SCALE)
    tx = jc.onebit_lamb(
        lr,
        freeze_step=FREEZE,
        axis_name="dp",
        bucket_bytes=bucket_bytes,
        deepspeed_compat=True,
        **kw,
    )
    history, state = run(tx, steps)
    params = init_params()
    model = OnebitLambModel(
        N,
        [params[k] for k in KEYS],
        lr=lr,
        freeze_step=FREEZE,
        bucket_sizes=[21, 11, 16, 5] if bucket_bytes == 1 else None,
        **kw,
    )
    for k, (grads, got) in enumerate(zip(steps, history, strict=True)):
        expected = model.step(flat_per_device(grads))
        np.testing.assert_allclose(flat(got), expected, rtol=1e-4, atol=1e-5, err_msg=f"step {k}")
    assert events <= model.events, model.events

    opt = state.opt_state
    assert int(opt.count) == len(GRAD_SCALE)
    np.testing.assert_allclose(per_leaf(opt.coeff_freeze), model.coeff_freeze, rtol=1e-4)
    np.testing.assert_allclose(per_leaf(opt.scaling_coeff), model.scaling_coeff, rtol=1e-4)
    np.testing.assert_allclose(per_leaf(opt.last_factor), model.last_factor, rtol=1e-4)
    np.testing.assert_allclose(flat(opt.mu), model.m, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(flat(opt.nu), model.v, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(flat(opt.nu_fresh), model.v_fresh, rtol=1e-4, atol=1e-9)
    # The compression stage really ran: the error feedback is non-zero and differs by device.
    errors = [np.asarray(leaf) for leaf in jax.tree.leaves(opt.comm)]
    assert errors and all(e.shape[0] == N for e in errors)
    assert any(np.abs(e).max() > 0 and not np.allclose(e[0], e[1]) for e in errors)
    specs = jc.state_partition_specs(opt, "dp")
    assert specs.count == P() and specs.coeff_freeze["a"] == P() and specs.mu["a"] == P()
    assert all(s == P("dp") for s in jax.tree.leaves(specs.comm))


@pytest.mark.parametrize("options", [{}, dict(bias_correction=True, precondition=True)])
def test_onebit_lamb_jaxcomm_rules_match_model(options):
    """jaxcomm's rules against the model with the same rules: the variance floor on both
    denominators after the switch (5 coordinates of "b" never get a gradient, so the floor
    matters), and the bias-correction and preconditioning options."""
    kw = dict(b2=0.5, weight_decay=0.01, max_coeff=15.0, min_coeff=0.05)
    lr = optax.linear_schedule(0.02, 0.01, len(GRAD_SCALE))
    steps = grad_steps(GRAD_SCALE)
    for grads in steps:
        grads["b"][:, :5] = 0.0
    tx = jc.onebit_lamb(lr, freeze_step=FREEZE, axis_name="dp", **kw, **options)
    history, state = run(tx, steps)
    params = init_params()
    model = OnebitLambModel(
        N, [params[k] for k in KEYS], lr=lr, freeze_step=FREEZE, variance_floor=0.1, **kw,
        **options,
    )  # fmt: skip
    for k, (grads, got) in enumerate(zip(steps, history, strict=True)):
        expected = model.step(flat_per_device(grads))
        np.testing.assert_allclose(flat(got), expected, rtol=1e-4, atol=1e-5, err_msg=f"step {k}")
    opt = state.opt_state
    np.testing.assert_allclose(per_leaf(opt.last_factor), model.last_factor, rtol=1e-4)
    np.testing.assert_allclose(flat(opt.nu_fresh), model.v_fresh, rtol=1e-4, atol=1e-9)
    # The rules matter here: DeepSpeed's model differs.
    deepspeed = OnebitLambModel(N, [params[k] for k in KEYS], lr=lr, freeze_step=FREEZE, **kw)
    for grads in steps:
        ds = deepspeed.step(flat_per_device(grads))
    assert not np.allclose(ds, flat(history[-1]), rtol=1e-3)


def test_onebit_lamb_pmap_and_inject_hyperparams():
    """Under jax.pmap with optax.inject_hyperparams (every numeric hyperparameter traced) the
    run is the shard_map run; the learning rate follows its schedule."""
    lr = optax.exponential_decay(0.02, 1, 0.9)
    kw = dict(weight_decay=0.01, freeze_step=2, b2=0.5, max_coeff=15.0, min_coeff=0.05)
    steps = grad_steps(GRAD_SCALE[:5], seed=7)
    plain, _ = run(jc.onebit_lamb(lr, axis_name="dp", **kw), steps)
    injected_tx = optax.inject_hyperparams(jc.onebit_lamb)(learning_rate=lr, axis_name="dp", **kw)
    injected, state = run(injected_tx, steps, pmap=True)
    for a, b in zip(plain, injected, strict=True):
        np.testing.assert_allclose(flat(a), flat(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(flat(plain[-1]), flat(plain[-2]))
    hp = jc.from_pmap_layout(state.opt_state).hyperparams
    np.testing.assert_allclose(float(hp["learning_rate"]), lr(len(steps) - 1), rtol=1e-6)


def test_onebit_lamb_bf16_params_stay_bf16():
    params = init_params(dtype=jnp.bfloat16)
    steps = grad_steps(GRAD_SCALE[:3], seed=11)
    tx = jc.onebit_lamb(0.01, freeze_step=1, axis_name="dp")
    history, state = run(tx, steps, params=params)
    assert all(v.dtype == jnp.bfloat16 for v in history[-1].values())
    opt = state.opt_state
    for tree in (opt.mu, opt.nu, opt.nu_fresh, opt.coeff_freeze, opt.scaling_coeff):
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(tree))
    # Same run in fp32 from the bf16-rounded start: close (bf16 parameter rounding only).
    p32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    ref, _ = run(tx, steps, params=p32)
    np.testing.assert_allclose(flat(history[-1]), flat(ref[-1]), rtol=2e-2, atol=2e-2)
    assert not np.allclose(flat(history[-1]), flat(p32))


def test_onebit_lamb_misuse_is_refused():
    with pytest.raises(TypeError, match="Compressor"):
        jc.onebit_lamb(axis_name="dp", compressor="onebit")
    with pytest.raises(ValueError, match="freeze_step"):
        jc.onebit_lamb(freeze_step=0, axis_name="dp")
    with pytest.raises(ValueError, match="min_coeff <= max_coeff"):
        jc.onebit_lamb(min_coeff=2.0, max_coeff=1.0, axis_name="dp")
    with pytest.raises(ValueError, match="factor_min <= factor_max"):
        jc.onebit_lamb(factor_min=2.0, factor_max=1.0, axis_name="dp")
    with pytest.raises(ValueError, match=r"b1 must be in \[0.0, 1.0\)"):
        jc.onebit_lamb(b1=1.0, axis_name="dp")
    with pytest.raises(ValueError, match="coeff_beta"):
        jc.onebit_lamb(coeff_beta=1.5, axis_name="dp")
    with pytest.raises(ValueError, match="factor_threshold"):
        jc.onebit_lamb(factor_threshold=-0.1, axis_name="dp")
    tx = jc.onebit_lamb(axis_name="dp", total_steps=100)
    g = {"g": jnp.ones((4,))}
    with pytest.raises(ValueError, match="params"):
        jax.vmap(lambda _: tx.update(g, tx.init(g)), axis_name="dp", axis_size=2)(jnp.zeros(2))


def test_onebit_lamb_zero_momentum_leaf_gets_scaling_one():
    """A leaf whose gradient is always 0 (a frozen embedding row block, say): DeepSpeed's
    ``united / 0`` would poison the whole fused buffer with NaN; here its scaling coefficient is
    1, it is counted in the mean with scale 0, and it never moves (its frozen coefficient is 0)."""
    params = {**init_params(), "z": np.zeros((6,), np.float32)}
    steps = [{**g, "z": np.zeros((N, 6), np.float32)} for g in grad_steps(GRAD_SCALE[:4])]
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = jc.onebit_lamb(0.01, freeze_step=2, axis_name="dp")
    step, state = jc.make_train_step(mesh, "dp", linear_loss, tx, params)
    for grads in steps[:2]:
        state, _ = step(state, grads)
    mu = {k: np.asarray(v, np.float64) for k, v in state.opt_state.mu.items()}
    scales = {k: np.linalg.norm(m) / np.sqrt(m.size) for k, m in mu.items()}
    assert scales["z"] == 0
    united = np.mean(list(scales.values()))
    for grads in steps[2:]:
        state, _ = step(state, grads)
    got = state.opt_state.scaling_coeff
    assert float(got["z"]) == 1.0
    for k in SHAPES:
        np.testing.assert_allclose(float(got[k]), united / scales[k], rtol=1e-5)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
    np.testing.assert_array_equal(np.asarray(state.params["z"]), 0.0)
    assert float(state.opt_state.coeff_freeze["z"]) == 0.0


@pytest.mark.parametrize("options", [dict(weight_decay=0.01), dict(precondition=True)])
def test_onebit_lamb_is_scale_by_onebit_lamb_then_the_learning_rate(options):
    """``jc.onebit_lamb`` multiplies ``-lr`` into each trust ratio before ``u``; with a
    power-of-two rate (a schedule of them here) that is exactly ``scale_by_learning_rate``
    after ``scale_by_onebit_lamb``'s direction ``c u``: updates, parameters and states bit for
    bit through the warm-up, the switch and the compressed steps."""
    lr = optax.piecewise_constant_schedule(2.0**-6, {4: 0.5})
    kw = dict(freeze_step=FREEZE, axis_name="dp", b2=0.5, max_coeff=15.0, min_coeff=0.05)
    alias = jc.onebit_lamb(lr, **kw, **options)
    chain = optax.chain(jc.scale_by_onebit_lamb(**kw, **options), optax.scale_by_learning_rate(lr))
    steps = grad_steps(GRAD_SCALE[:7])
    want = run_updates(alias, init_params(), steps)
    got = run_updates(chain, init_params(), steps)
    for t, ((u_a, p_a, s_a), (u_c, p_c, s_c)) in enumerate(zip(want, got, strict=True)):
        assert_bitwise_equal((u_c, p_c, s_c[0]), (u_a, p_a, s_a), f"step {t}")
    assert int(s_a.count) == 7 and not np.array_equal(flat(p_a), flat(init_params()))


def test_onebit_lamb_keeps_the_mean_of_its_frozen_variance():
    """``state.nu_mean`` (what the compressed steps' floored denominators read instead of a
    pass over the frozen ``nu``) is each leaf's mean of ``nu`` after every step: taken by the
    warm-up updates, kept by a skipped one (a NaN gradient) and by the compressed ones."""
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = jc.onebit_lamb(0.01, freeze_step=FREEZE, axis_name="dp")
    step, state = jc.make_train_step(mesh, "dp", linear_loss, tx, init_params())
    steps = grad_steps(GRAD_SCALE[:7])
    bad = {k: g.copy() for k, g in steps[1].items()}
    bad["a"][3, 0, 0] = np.nan
    for t, grads in enumerate(steps[:1] + [bad] + steps[1:]):
        before = jax.tree.map(np.asarray, state.opt_state)  # the step donates its state
        state, _ = step(state, grads)
        opt = state.opt_state
        for k in SHAPES:
            nu = np.asarray(opt.nu[k])
            np.testing.assert_allclose(float(opt.nu_mean[k]), nu.mean(), rtol=1e-6, err_msg=k)
            if t == 1:  # skipped: both kept
                np.testing.assert_array_equal(nu, before.nu[k])
                assert float(opt.nu_mean[k]) == float(before.nu_mean[k])
    assert int(state.opt_state.skips.total) == 1 and int(state.opt_state.count) == 7
