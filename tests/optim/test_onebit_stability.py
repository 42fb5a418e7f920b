"""1-bit Adam after a short warm-up: bounded, not silently divergent (and the run length).

The failure this guards against: with ``v`` frozen after a few steps, early in training, the
gradients keep growing while the denominator does not, so the step ``m / sqrt(v_frozen)``
grows with them, the loss with the step and the gradients with the loss, until the run is NaN.
It is the frozen variance, not the compression: exact Adam with a frozen ``v``
(``compressor=jc.NoCompression()``) diverges the same way. Two models reproduce it: a GPT-style
LM (tied embedding, fused qkv with bias, bf16 matmuls, every tensor initialised N(0, 0.02) as in
``benchmarks/aot_report.py``, where the growing LayerNorm gains make the gradients grow) and an
MLP regression with a small initialisation. Each test first shows the unbounded rule
(``max_step_rms=None``, the rule before the bound) diverging on its model, then the default
training like exact Adam on the same batches.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc

N = 2  # devices, simulated with vmap


def _train(tx, loss_fn, params, batches, steps):
    """Losses of ``steps`` data-parallel steps over ``N`` vmapped devices; ``batches[k % len]``
    is ``(N, ...)`` per leaf (each device its own rows)."""
    state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(N))

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0))(params, batch)
        updates, state = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")(
            grads, state
        )
        return optax.apply_updates(params, jax.tree.map(lambda u: u[0], updates)), state, loss

    losses = []
    for k in range(steps):
        params, state, loss = step(params, state, batches[k % len(batches)])
        losses.append(float(jnp.mean(loss)))
    return np.array(losses)


def _adam(lr):
    """Exact data-parallel Adam: the mean gradient over the devices, then ``optax.adam``."""
    adam = optax.adam(lr)

    def update(grads, state, params=None):
        return adam.update(jax.lax.pmean(grads, "dp"), state, params)

    return optax.GradientTransformation(adam.init, update)


def _onebit(lr, freeze_step, **kw):
    return jc.onebit_adam(
        lr, freeze_step=freeze_step, axis_name="dp", axis_size=N, max_consecutive_skips=None, **kw
    )


# A GPT-style LM (benchmarks/aot_report.py's model, small).

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 2048, 96, 4, 2, 48, 4


def gpt_init(seed: int = 0) -> dict:
    def block():
        d = WIDTH
        return dict(ln1_g=(d,), ln1_b=(d,), qkv_w=(d, 3 * d), qkv_b=(3 * d,), proj_w=(d, d),
                    proj_b=(d,), ln2_g=(d,), ln2_b=(d,), fc_w=(d, 4 * d), fc_b=(4 * d,),
                    out_w=(4 * d, d), out_b=(d,))  # fmt: skip

    shapes = dict(wte=(VOCAB, WIDTH), wpe=(SEQ, WIDTH), lnf_g=(WIDTH,), lnf_b=(WIDTH,))
    shapes["blocks"] = {f"h{i}": block() for i in range(LAYERS)}
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [0.02 * jax.random.normal(k, s) for k, s in zip(keys, leaves, strict=True)]
    )


def _ln(x, g, b):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(jnp.bfloat16)


def gpt_loss(p, tokens):
    def bf(w):
        return w.astype(jnp.bfloat16)

    x, y = tokens[:, :-1], tokens[:, 1:]
    s, hd = x.shape[1], WIDTH // HEADS
    act = (p["wte"][x] + p["wpe"][:s]).astype(jnp.bfloat16)
    causal = jnp.tril(jnp.ones((s, s), bool))
    for name in sorted(p["blocks"]):
        b = p["blocks"][name]
        a = _ln(act.astype(jnp.float32), b["ln1_g"], b["ln1_b"])
        qkv = (a @ bf(b["qkv_w"]) + bf(b["qkv_b"])).reshape(*a.shape[:2], 3, HEADS, hd)
        att = jnp.einsum("bqhd,bkhd->bhqk", qkv[:, :, 0], qkv[:, :, 1]).astype(jnp.float32)
        att = jax.nn.softmax(jnp.where(causal, att / math.sqrt(hd), -1e9), -1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att.astype(jnp.bfloat16), qkv[:, :, 2])
        act = act + o.reshape(a.shape) @ bf(b["proj_w"]) + bf(b["proj_b"])
        a = _ln(act.astype(jnp.float32), b["ln2_g"], b["ln2_b"])
        act = act + jax.nn.gelu(a @ bf(b["fc_w"]) + bf(b["fc_b"])) @ bf(b["out_w"]) + bf(b["out_b"])
    act = _ln(act.astype(jnp.float32), p["lnf_g"], p["lnf_b"])
    logits = (act @ bf(p["wte"]).T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def gpt_batches():
    """Two fixed random-token batches, repeated (the reported runs' data)."""
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.integers(0, VOCAB, (N, BATCH, SEQ + 1)), jnp.int32) for _ in range(2)]


# An MLP regression with a small initialisation (its gradients grow as its weights do).


def mlp_init(seed: int = 0) -> list:
    sizes = [16, 64, 64, 64, 64, 4]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    return [
        {"w": 0.02 * jax.random.normal(k, (a, b)), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(p, batch):
    x, y = batch
    for layer in p[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean(jnp.square(x @ p[-1]["w"] + p[-1]["b"] - y))


def mlp_batches():
    x = jax.random.normal(jax.random.PRNGKey(1), (N, 128, 16))
    y = jnp.sin(x @ jax.random.normal(jax.random.PRNGKey(2), (16, 4)))
    return [(x, y)]


CASES = {  # name: (loss, params, batches, lr, steps)
    "gpt": (gpt_loss, gpt_init, gpt_batches, 3e-3, 14),
    "mlp": (mlp_loss, mlp_init, mlp_batches, 1e-2, 40),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_short_warmup_is_bounded(case):
    """Frozen after 2 exact steps: the unbounded rule diverges (the reported failure, on this
    model), the default trains: finite, never 5% above its start, and within 5% of exact
    Adam's loss over the last steps."""
    loss_fn, init, batches, lr, steps = CASES[case]
    data = batches()
    adam = _train(_adam(lr), loss_fn, init(), data, steps)
    unbounded = _train(_onebit(lr, 2, max_step_rms=None), loss_fn, init(), data, steps)
    bounded = _train(_onebit(lr, 2), loss_fn, init(), data, steps)
    start = adam[0]
    assert not np.all(np.isfinite(unbounded)) or unbounded.max() > 2 * start, unbounded
    assert np.all(np.isfinite(bounded)), bounded
    assert bounded.max() < 1.05 * start, bounded
    tail = slice(-4, None)
    assert bounded[tail].mean() < 1.05 * adam[tail].mean(), (bounded, adam)
    assert adam[tail].mean() < start and bounded[tail].mean() < start


def test_frozen_variance_alone_diverges_and_is_bounded():
    """Exact communication, ``v`` frozen after 2 steps: the divergence is the frozen variance's,
    and the bound removes it too."""
    loss_fn, init, batches, lr, steps = CASES["mlp"]
    exact = dict(compressor=jc.NoCompression())
    unbounded = _train(
        _onebit(lr, 2, max_step_rms=None, **exact), loss_fn, init(), batches(), steps
    )
    bounded = _train(_onebit(lr, 2, **exact), loss_fn, init(), batches(), steps)
    assert not np.all(np.isfinite(unbounded)) or unbounded.max() > 2 * unbounded[0], unbounded
    assert np.all(np.isfinite(bounded)) and bounded[-1] < bounded[0], bounded


def _one_update(max_step_rms, grads, freeze_step=1):
    """The update of the second step (the first compressed one) from the same first step."""
    tx = _onebit(0.1, freeze_step, max_step_rms=max_step_rms)
    params = {"a": jnp.zeros(6), "b": jnp.zeros((2, 3))}
    step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")
    state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(N))
    _, state = step(grads[0], state)
    updates, _ = step(grads[1], state)
    return jax.tree.map(lambda u: np.asarray(u[0], np.float64), updates)


def test_bound_is_the_leaf_rms_rule():
    """After the freeze the update is the unbounded one times ``min(1, bound / rms)`` per leaf
    (rms in units of the learning rate, 0.1); a bound above every leaf's rms changes nothing,
    bit for bit. The second gradients are 30x the first: every leaf's step grows far past 1."""
    rng = np.random.default_rng(3)
    g0 = {"a": rng.normal(size=(N, 6)), "b": rng.normal(size=(N, 2, 3))}
    g1 = jax.tree.map(lambda x: 30 * x + rng.normal(size=x.shape), g0)
    grads = [jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g) for g in (g0, g1)]
    free = _one_update(None, grads)
    for bound in (0.5, 2.0):
        got = _one_update(bound, grads)
        for name in free:
            rms = np.sqrt(np.mean(np.square(free[name] / 0.1)))
            assert rms > 2.0  # the bound binds for both values
            expected = free[name] * min(1.0, bound / rms)
            np.testing.assert_allclose(got[name], expected, rtol=1e-5, err_msg=name)
            assert np.sqrt(np.mean(np.square(got[name] / 0.1))) == pytest.approx(bound, 1e-5)
    loose = _one_update(1e6, grads)
    for name in free:
        np.testing.assert_array_equal(loose[name], free[name])
    # In the warm-up (nothing frozen yet) the bound does not apply at all.
    warm = _one_update(1e-3, grads, freeze_step=5)
    warm_free = _one_update(None, grads, freeze_step=5)
    for name in free:
        np.testing.assert_array_equal(warm[name], warm_free[name])


# Run length: no silent 100000-step default.


@pytest.mark.parametrize("make", [jc.onebit_adam, jc.onebit_lamb])
def test_run_length_is_required(make):
    with pytest.raises(ValueError, match="total_steps=N .* or freeze_step=K"):
        make(1e-3, axis_name="dp")
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
            make(1e-3, axis_name="dp", total_steps=bad)


@pytest.mark.parametrize("make", [jc.onebit_adam, jc.onebit_lamb])
def test_total_steps_freezes_after_15_percent(make):
    """``total_steps=40`` is ``freeze_step=6`` (round(0.15 * 40)), step for step, and not 5 or 7;
    an explicit ``freeze_step`` wins over ``total_steps``."""
    rng = np.random.default_rng(0)
    grads = [{"w": jnp.asarray(rng.normal(size=(N, 8)), jnp.float32)} for _ in range(9)]
    params = {"w": jnp.ones(8)}

    def updates(tx):
        step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp"))
        state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(N))
        out = []
        for g in grads:
            u, state = step(g, state)
            out.append(np.asarray(u["w"][0]))
        return np.stack(out)

    kw = dict(axis_name="dp", axis_size=N)
    derived = updates(make(1e-2, total_steps=40, **kw))
    np.testing.assert_array_equal(derived, updates(make(1e-2, freeze_step=6, **kw)))
    for other in (5, 7):
        assert not np.array_equal(derived, updates(make(1e-2, freeze_step=other, **kw)))
    explicit = updates(make(1e-2, freeze_step=5, total_steps=40, **kw))
    np.testing.assert_array_equal(explicit, updates(make(1e-2, freeze_step=5, **kw)))


def test_bad_bound_is_refused():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="max_step_rms must be > 0 or None"):
            jc.onebit_adam(1e-3, axis_name="dp", freeze_step=2, max_step_rms=bad)
