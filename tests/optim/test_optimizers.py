"""jaxcomm's optax transformations against NumPy models of DeepSpeed's optimizers.

Every test runs on 8 simulated devices. Gradients are chosen per device and per step by feeding
them through the batch of a linear "loss" ``sum(p * g)``, so the whole data-parallel path
(:func:`jc.make_train_step`: local grads -> transformation -> params) is what is compared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES
from tests.reference.adam_reference import OnebitAdamModel, ZeroOneAdamModel
from tests.reference.onebit_reference import OneBitAllReduceModel

N = NUM_DEVICES
SHAPES = {"a": (3, 7), "b": (11,)}  # tree order a, b: 21 + 11 = 32 elements
SIZES = [21, 11]


def linear_loss(params, batch):
    """d loss / d params = this device's row of the batch: the gradients are the data."""
    return sum(jnp.sum(params[k] * batch[k][0].astype(params[k].dtype)) for k in params)


def init_params(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}


def grad_steps(steps, seed=1, scale=1.0):
    """Per step, a dict of per-device gradients ``(N, *shape)``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        # A shared component plus per-device noise, like real data-parallel gradients.
        common = {k: rng.normal(size=s) for k, s in SHAPES.items()}
        out.append(
            {
                k: (scale * (common[k][None] + 0.5 * rng.normal(size=(N, *s)))).astype(np.float32)
                for k, s in SHAPES.items()
            }
        )
    return out


def flat(tree):
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(-1) for k in sorted(SHAPES)])


def flat_per_device(tree):
    return np.concatenate(
        [np.asarray(tree[k], np.float64).reshape(N, -1) for k in sorted(SHAPES)], axis=1
    )


def run(tx, steps, params=None, phased=False):
    """Params after each step (global layout) for the data-parallel step over ``steps``
    (``phased``: ``make_train_step(..., specialize_phases=True)``)."""
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    step, state = jc.make_train_step(
        mesh, "dp", linear_loss, tx, params or init_params(), specialize_phases=phased
    )
    history = []
    for grads in steps:
        state, _ = step(state, grads)
        history.append(jax.tree.map(np.asarray, state.params))
    return history, state


ONEBIT_FREEZE, ONEBIT_STEPS = 3, 9


def onebit_adam_and_model(bucket_bytes, tx_rules: dict, model_rules: dict):
    """``jc.onebit_adam`` and its NumPy model with the same schedule: 3 warm-up steps of 9, an
    lr schedule and weight decay; ``bucket_bytes=1`` puts each leaf in its own bucket."""
    lr = optax.linear_schedule(0.02, 0.005, ONEBIT_STEPS)
    common = dict(weight_decay=0.01, freeze_step=ONEBIT_FREEZE)
    tx = jc.onebit_adam(lr, axis_name="dp", bucket_bytes=bucket_bytes, **common, **tx_rules)
    buckets = SIZES if bucket_bytes == 1 else None
    model = OnebitAdamModel(
        N, flat(init_params()), lr=lr, bucket_sizes=buckets, **common, **model_rules
    )
    return tx, model


@pytest.mark.parametrize("bucket_bytes,bias_correction", [(None, False), (1, False), (None, True)])
def test_onebit_adam_matches_deepspeed_model(bucket_bytes, bias_correction):
    """Warm-up (exact) then compression (1-bit momentum), weight decay and an lr schedule.

    ``bucket_bytes=1`` puts each leaf in its own bucket: DeepSpeed's per-tensor compression.
    ``deepspeed_compat=True``: DeepSpeed's rules exactly (no variance floor).
    """
    tx, model = onebit_adam_and_model(
        bucket_bytes,
        dict(bias_correction=bias_correction, deepspeed_compat=True),
        dict(bias_correction=bias_correction),
    )
    steps = grad_steps(ONEBIT_STEPS)
    history, state = run(tx, steps)
    for k, (grads, got) in enumerate(zip(steps, history, strict=True)):
        expected = model.step(flat_per_device(grads))
        np.testing.assert_allclose(flat(got), expected, rtol=1e-4, atol=1e-5, err_msg=f"step {k}")
    # The compression stage really ran: the error feedback is non-zero and differs by device.
    errors = [np.asarray(leaf) for leaf in jax.tree.leaves(state.opt_state.comm)]
    assert all(e.shape[0] == N for e in errors)
    assert any(np.abs(e).max() > 0 for e in errors)
    assert any(not np.allclose(e[0], e[1]) for e in errors)


@pytest.mark.parametrize("bucket_bytes,phased", [(None, False), (1, True)])
def test_onebit_adam_jaxcomm_rules_match_model(bucket_bytes, phased):
    """jaxcomm's default rules (bias correction, variance floor, preconditioned 1-bit momentum)
    with a momentum mask, weight decay and an lr schedule, against the NumPy model; after the
    freeze the state is in the step's space (mu = m / d, nu = d), in the single program and in
    the phase-specialised one."""
    mask = {"a": np.ones(SHAPES["a"], np.float32), "b": np.ones(SHAPES["b"], np.float32)}
    mask["b"][:3] = 0
    rules = dict(bias_correction=True, variance_floor=0.1, leaf_sizes=SIZES, precondition=True)
    tx, model = onebit_adam_and_model(
        bucket_bytes, dict(momentum_mask=mask), dict(rules, mask=flat(mask))
    )
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    step, state = jc.make_train_step(
        mesh, "dp", linear_loss, tx, init_params(), specialize_phases=phased
    )
    for k, grads in enumerate(grad_steps(ONEBIT_STEPS)):
        state, _ = step(state, grads)
        expected = model.step(flat_per_device(grads))
        np.testing.assert_allclose(flat(state.params), expected, rtol=1e-4, atol=1e-5, err_msg=k)
    opt = state.opt_state
    assert bool(opt.preconditioned)
    np.testing.assert_allclose(flat(opt.nu), model.denominator(), rtol=1e-5)
    np.testing.assert_allclose(flat(opt.mu) * flat(opt.nu), model.m, rtol=1e-4, atol=1e-7)
    if phased:
        assert set(step.compiled_phases) == {(0,), (1,), (2,)}


def test_onebit_adam_compression_changes_the_result():
    """Sanity check of the model test: with an exact compressor the results differ."""
    steps = grad_steps(4)
    kw = dict(learning_rate=0.02, freeze_step=1, axis_name="dp")
    onebit, _ = run(jc.onebit_adam(**kw), steps)
    exact, _ = run(jc.onebit_adam(compressor=jc.NoCompression(), **kw), steps)
    assert not np.allclose(flat(onebit[-1]), flat(exact[-1]), rtol=1e-4)


#: A 0/1 Adam schedule short enough for a test that reaches every kind of step.
ZERO_ONE_KW = dict(
    weight_decay=0.01,
    var_freeze_step=6,
    var_update_scaler=2,
    local_step_scaler=2,
    local_step_clipper=4,
)
ZERO_ONE_STEPS = 15


def _zero_one_run():
    """``(kw, lr, steps)`` of the 0/1 Adam model tests: ZERO_ONE_KW, an lr schedule and the
    gradient steps."""
    lr = optax.linear_schedule(0.02, 0.01, ZERO_ONE_STEPS)
    return dict(ZERO_ONE_KW), lr, grad_steps(ZERO_ONE_STEPS, seed=5)


def test_zero_one_adam_matches_deepspeed_model():
    """Every rule of 0/1 Adam: exact variance steps, 1-bit momentum steps, the variance freeze
    (errors zeroed), local steps and synchronisations with a growing interval."""
    kw, lr, steps = _zero_one_run()
    history, state = run(jc.zero_one_adam(lr, axis_name="dp", deepspeed_compat=True, **kw), steps)
    model = ZeroOneAdamModel(N, flat(init_params()), lr=lr, **kw)
    for k, (grads, got) in enumerate(zip(steps, history, strict=True)):
        expected = model.step(flat_per_device(grads))
        # Parameters are per device: (N, *shape) in the global layout.
        assert got["a"].shape == (N, *SHAPES["a"])
        np.testing.assert_allclose(
            flat_per_device(got), expected, rtol=1e-4, atol=1e-5, err_msg=f"step {k}"
        )
    assert set(model.branches) == {"variance", "onebit", "local", "sync"}, model.branches
    assert model.branches[-1] == "local"  # so the final params differ between devices
    final = history[-1]["a"]
    assert not np.allclose(final[0], final[1])
    assert int(state.opt_state.local_interval) == model.local_interval == 4
    assert int(state.opt_state.var_interval) == model.var_interval


@pytest.mark.parametrize("precondition", [True, False])
def test_zero_one_adam_jaxcomm_rules_match_model(precondition):
    """jaxcomm's default rules (not DeepSpeed's), against the NumPy model with the same rules:
    bias correction (v by the steps its updates cover), the interval-weighted variance EMA, the
    variance floor, 1-bit momentum (not gradients) in the variance stage, preconditioned 1-bit
    means; every branch, weight decay and an lr schedule."""
    kw, lr, steps = _zero_one_run()
    tx = jc.zero_one_adam(lr, axis_name="dp", precondition=precondition, **kw)
    history, state = run(tx, steps)
    model = ZeroOneAdamModel(
        N,
        flat(init_params()),
        lr=lr,
        bias_correction=True,
        variance_floor=0.1,
        leaf_sizes=SIZES,
        compress_momentum=True,
        precondition=precondition,
        interval_weighted_variance=True,
        **kw,
    )
    for k, (grads, got) in enumerate(zip(steps, history, strict=True)):
        expected = model.step(flat_per_device(grads))
        np.testing.assert_allclose(
            flat_per_device(got), expected, rtol=1e-4, atol=1e-5, err_msg=f"step {k}"
        )
    assert set(model.branches) == {"variance", "onebit", "local", "sync"}, model.branches
    assert int(state.opt_state.var_updates) == model.var_steps > model.branches.count("variance")
    # The rules matter here: DeepSpeed's model differs.
    deepspeed = ZeroOneAdamModel(N, flat(init_params()), lr=lr, **kw)
    for grads in steps:
        ds = deepspeed.step(flat_per_device(grads))
    assert not np.allclose(ds, flat_per_device(history[-1]), rtol=1e-3)


def test_zero_one_adam_default_schedule():
    """Defaults: the run-length schedule from total_steps, interval cap 2 (16 under
    deepspeed_compat), DeepSpeed's constants without total_steps."""
    from jaxcomm.optim.zero_one_adam import SAFE_LOCAL_STEP_CLIPPER, schedule_for

    assert schedule_for(768, None, None) == (115, 38)
    assert schedule_for(None, None, None) == (100000, 32678)
    assert schedule_for(768, 50, None) == (50, 17)
    steps = grad_steps(12, seed=3)
    for compat, cap in ((False, SAFE_LOCAL_STEP_CLIPPER), (True, 16)):
        tx = jc.zero_one_adam(
            0.01, var_freeze_step=1, local_step_scaler=1, axis_name="dp", deepspeed_compat=compat
        )
        _, state = run(tx, steps)
        assert int(state.opt_state.local_interval) == min(cap, 2**10)


def test_compressed_mean_warmup_then_onebit_in_a_manual_shard_map(mesh):
    """compressed_mean used by hand: init outside, stack, state_partition_specs, shard_map."""
    warmup = 2
    tx = jc.compressed_mean("dp", warmup_steps=warmup)
    like = {"g": np.zeros((40,), np.float32)}
    state = tx.init(like)  # outside any mapped context: axis size = jax.device_count() = 8
    global_state = jc.stack_per_device(state, N)
    specs = jc.state_partition_specs(global_state, "dp")
    assert specs.count == P() and all(s == P("dp") for s in jax.tree.leaves(specs.comm))

    def body(g, s):
        mean, s = tx.update(jax.tree.map(lambda x: x[0], g), jc.local_view(s))
        return mean, jc.global_view(s)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), specs), out_specs=(P(), specs))
    )
    rng = np.random.default_rng(3)
    model = OneBitAllReduceModel(N, 40)
    for k in range(5):
        g = {"g": rng.normal(size=(N, 40)).astype(np.float32)}
        mean, global_state = step(g, global_state)
        expected = g["g"].mean(0) if k < warmup else model.step(g["g"])
        np.testing.assert_allclose(mean["g"], expected, rtol=2e-5, atol=2e-6, err_msg=f"step {k}")
    assert int(global_state.count) == 5


def test_compressed_mean_no_compression_is_exact_sgd():
    """Chained before optax: exact data parallelism is mean gradient then the optimizer."""
    steps = grad_steps(3, seed=7)
    tx = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.sgd(0.1))
    history, _ = run(tx, steps)
    p = flat(init_params())
    for grads, got in zip(steps, history, strict=True):
        p = p - 0.1 * flat_per_device(grads).mean(0)
        np.testing.assert_allclose(flat(got), p, rtol=1e-6, atol=1e-6)


def test_inject_hyperparams_learning_rate():
    """optax.inject_hyperparams: a scheduled lr gives the same run; the lr can then be set."""
    lr = optax.exponential_decay(0.02, 1, 0.8)
    steps = grad_steps(4, seed=9)
    kw = dict(freeze_step=2, axis_name="dp")
    plain, _ = run(jc.onebit_adam(lr, **kw), steps)
    injected_tx = optax.inject_hyperparams(jc.onebit_adam)(learning_rate=lr, **kw)
    injected, state = run(injected_tx, steps)
    for a, b in zip(plain, injected, strict=True):
        np.testing.assert_allclose(flat(a), flat(b), rtol=1e-6, atol=1e-7)
    hp = state.opt_state.hyperparams
    np.testing.assert_allclose(float(hp["learning_rate"]), lr(3), rtol=1e-6)
    # Hyperparameters are replicated leaves; the error feedback is per device.
    specs = jc.state_partition_specs(state.opt_state, "dp")
    assert specs.hyperparams["learning_rate"] == P()
    assert all(s == P("dp") for s in jax.tree.leaves(specs.inner_state.comm))


def test_bf16_params_stay_bf16():
    params = init_params(dtype=jnp.bfloat16)
    steps = grad_steps(3, seed=11)
    tx = jc.onebit_adam(0.01, freeze_step=1, axis_name="dp")
    history, state = run(tx, steps, params=params)
    assert all(v.dtype == jnp.bfloat16 for v in history[-1].values())
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.opt_state.mu))
    assert not np.array_equal(
        np.asarray(history[-1]["a"], np.float32), np.asarray(params["a"], np.float32)
    )
    # Updates come back in the parameters' dtype, also from a direct call.
    g = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
    tx = jc.onebit_adam(0.01, axis_name="dp", freeze_step=100, compressor=jc.NoCompression())
    updates = jax.vmap(
        lambda _: tx.update(g, tx.init(params), params)[0], axis_name="dp", axis_size=N
    )(jnp.zeros(N))
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))


def test_init_axis_size_resolution():
    like = {"g": jnp.zeros((10,))}
    tx = jc.compressed_mean("dp")
    # Explicit, else bound axis (vmap binds it), else jax.device_count().
    explicit = jc.compressed_mean("dp", axis_size=2).init(like)
    assert explicit.comm.buckets[0].worker_error.shape == (16,)  # padded to 8 * 2
    bound = jax.vmap(lambda _: tx.init(like), axis_name="dp", axis_size=4)(jnp.zeros(4))
    assert bound.comm.buckets[0].worker_error.shape == (4, 32)
    assert tx.init(like).comm.buckets[0].worker_error.shape == (8 * jax.device_count(),)
    with pytest.raises(ValueError, match="axis_size"):
        jc.compressed_mean("dp", axis_size=0).init(like)


def test_misuse_is_refused():
    with pytest.raises(TypeError, match="Compressor"):
        jc.onebit_adam(axis_name="dp", compressor="onebit")
    tx = jc.onebit_adam(weight_decay=0.1, axis_name="dp", total_steps=100)
    g = {"g": jnp.ones((4,))}
    with pytest.raises(ValueError, match="params"):
        jax.vmap(lambda _: tx.update(g, tx.init(g)), axis_name="dp", axis_size=2)(jnp.zeros(2))
    # Outside the mapped context the collective names the missing axis.
    tx = jc.compressed_mean("dp")
    with pytest.raises(ValueError, match="not bound"):
        tx.update(g, tx.init(g))


def test_update_works_under_check_vma_off_and_lax_cond_types(mesh):
    """The warm-up lax.cond has identically typed branches with and without check_vma."""
    tx = jc.onebit_adam(0.01, freeze_step=1, axis_name="dp")
    params = {"g": jnp.ones((16,))}
    state = jc.stack_per_device(tx.init(params), N)
    specs = jc.state_partition_specs(state, "dp")
    results = []
    for check_vma in (True, False):

        def body(g, s):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), jc.local_view(s), params)
            return u, jc.global_view(s)

        fn = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("dp"), specs),
                out_specs=(P(), specs),
                check_vma=check_vma,
            )
        )
        g = {"g": jnp.arange(N * 16, dtype=jnp.float32).reshape(N, 16)}
        u1, s1 = fn(g, state)
        u2, _ = fn(g, s1)
        results.append((u1, u2))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(a["g"]), np.asarray(b["g"]))
    # Step 1 is warm-up: the exact mean of the gradients drives m (bias-corrected by default:
    # m / (1 - b1), v / (1 - b2)).
    mean = np.arange(N * 16, dtype=np.float64).reshape(N, 16).mean(0)
    m, v = 0.1 * mean / 0.1, 0.001 * mean**2 / 0.001
    np.testing.assert_allclose(results[0][0]["g"], -0.01 * m / (np.sqrt(v) + 1e-8), rtol=1e-5)
