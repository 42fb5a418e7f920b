"""jc.sharded: ZeRO-style sharded optimizer over compressed reduce-scatter and all-gather."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc
from jaxcomm.inspect import collectives_in_hlo, wire_bytes
from jaxcomm.optim.sharded import ShardedState, shard_of
from tests.conftest import NUM_DEVICES
from tests.docs.test_examples import EPS32, assert_params_close
from tests.reference.quantize_reference import dequantize, layout, quantize

N = NUM_DEVICES
STEPS = 6


def problem(seed=0, batch=4 * N):
    """A two-layer regression whose leaves do not divide by 8 (padding) plus a scalar leaf."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": (0.3 * rng.normal(size=(13, 7))).astype(np.float32),
        "b1": np.zeros((7,), np.float32),
        "w2": (0.3 * rng.normal(size=(7, 3))).astype(np.float32),
        "s": np.ones((), np.float32),
    }
    x = rng.normal(size=(batch, 13)).astype(np.float32)
    y = rng.normal(size=(batch, 3)).astype(np.float32)
    return params, (x, y)


def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((p["s"] * (h @ p["w2"]) - y) ** 2)


def batches(seed=1, steps=STEPS):
    """Inputs and the outputs of a fixed teacher network (learnable targets)."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(13, 3)).astype(np.float32)
    for _ in range(steps):
        x = rng.normal(size=(4 * N, 13)).astype(np.float32)
        yield x, np.tanh(x @ teacher).astype(np.float32)


def full_batch_optax(tx, params, data):
    """Plain optax on one device with the whole global batch: what exact data parallel is."""
    params = jax.tree.map(jnp.asarray, params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in data:
        params, opt_state = step(params, opt_state, batch)
    return params


def assert_close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


INNER = {
    "adamw": lambda: optax.adamw(3e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-2, weight_decay=0.05),
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", sorted(INNER))
def test_exact_sharded_equals_plain_data_parallel(mesh, name):
    params, _ = problem()
    tx = jc.sharded(INNER[name](), "dp")
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    for batch in batches():
        state, _ = step(state, batch)
    reference = full_batch_optax(INNER[name](), params, batches())
    # Exact collectives: only the order of the fp32 sums differs (reduce-scatter vs all-reduce),
    # a few ulps per step that Adam's 1/sqrt(v) can amplify on one coordinate: compared over
    # the whole tree, relative to the distance travelled (bound: 100 eps per step).
    assert_params_close(state.params, reference, start=params, steps=STEPS)
    # The criterion tells a real bug apart: the same run missing its last step fails it.
    short = full_batch_optax(INNER[name](), params, batches(steps=STEPS - 1))
    with pytest.raises(AssertionError, match="after 6 steps"):
        assert_params_close(state.params, short, start=params, steps=STEPS)
    # Parameters stay replicated (the gathered result is identical on every device).
    assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(state.params))


def test_pmap_step_matches_shard_map(mesh):
    params, _ = problem()
    tx = jc.sharded(optax.adamw(3e-2, weight_decay=0.1), "dp", bucket_bytes=256)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    pstep, pstate = jc.make_pmap_train_step("dp", loss_fn, tx, params)
    for batch in batches(steps=3):
        state, _ = step(state, batch)
        pstate, _ = pstep(pstate, batch)
    got = jc.from_pmap_layout(pstate)
    assert_close(got.params, state.params, rtol=1e-6, atol=1e-7)
    assert_close(got.opt_state, state.opt_state, rtol=1e-6, atol=1e-7)


def opt_state_bytes_per_device(opt_state) -> int:
    """Bytes of the optimizer state that device 0 holds, read from the arrays themselves."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(opt_state))


def test_optimizer_state_memory_is_one_nth(mesh, capsys):
    # A model of 1.04M parameters whose leaves do not divide by 8.
    params = {
        "w": np.zeros((1021, 1019), np.float32),
        "b": np.zeros((1019,), np.float32),
        "s": np.zeros((), np.float32),
    }
    numel = sum(p.size for p in params.values())
    inner = optax.adam(1e-3)
    plain = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), inner)
    _, plain_state = jc.make_train_step(mesh, "dp", loss_fn, plain, params)
    _, sharded_state = jc.make_train_step(mesh, "dp", loss_fn, jc.sharded(inner, "dp"), params)
    _, qwz_state = jc.make_train_step(
        mesh, "dp", loss_fn, jc.sharded(inner, "dp", gather_compressor=jc.Quantize(8)), params
    )
    plain_b = opt_state_bytes_per_device(plain_state.opt_state)
    sharded_b = opt_state_bytes_per_device(sharded_state.opt_state)
    qwz_b = opt_state_bytes_per_device(qwz_state.opt_state)
    # Plain: Adam's mu and nu, fp32, replicated, plus two int32 counts (Adam, compressed_mean).
    assert plain_b == 2 * 4 * numel + 8
    # Sharded: the same for the ceil(numel/n) shard of every leaf, plus Adam's count and the
    # two int32 skip counters (SkipCounters: consecutive, total).
    shard = sum(-(-p.size // N) for p in params.values())
    assert sharded_b == 2 * 4 * shard + 4 + 8
    assert shard - numel / N < len(params)  # padding: < 1 element per leaf
    assert sharded_b <= plain_b / N + 2 * 4 * len(params) + 4 + 8
    # qwZ keeps the exact master shard on its owner as well (and one bool).
    assert qwz_b == sharded_b + 4 * shard + 1
    with capsys.disabled():
        print(
            f"\noptimizer state per device, {N} devices, {numel:,} params (Adam): plain "
            f"{plain_b:,} B, sharded {sharded_b:,} B ({plain_b / sharded_b:.2f}x less), sharded "
            f"+ qwZ master {qwz_b:,} B"
        )


def compiled_step_text(mesh, tx, params):
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    batch = next(batches())
    return step.lower(state, batch).compile().as_text(), step, state


def test_hlo_payloads_exact_and_int8(mesh):
    params = {"w": np.zeros((256, 96), np.float32), "b": np.zeros((96,), np.float32)}

    def loss(p, batch):
        return jnp.mean((batch[0] @ jnp.ones((13, 256)) @ p["w"] + p["b"]) ** 2)

    numel = 256 * 96 + 96
    plain = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(1e-3))
    texts = {}
    for name, tx in {
        "plain": plain,
        "exact": jc.sharded(optax.adam(1e-3), "dp"),
        "int8": jc.sharded(
            optax.adam(1e-3),
            "dp",
            compressor=jc.Quantize(bits=8, error_feedback=True),
            gather_compressor=jc.Quantize(bits=8),
        ),
    }.items():
        step, state = jc.make_train_step(mesh, "dp", loss, tx, params)
        texts[name] = step.lower(state, next(batches())).compile().as_text()
    big = 4096  # bytes; scales, losses and counts are below

    def payloads(text):
        return {(o.op, o.dtypes) for o in collectives_in_hlo(text) if o.payload_bytes > big}

    assert payloads(texts["plain"]) == {("all-reduce", ("f32",))}
    assert payloads(texts["exact"]) == {("reduce-scatter", ("f32",)), ("all-gather", ("f32",))}
    # qgZ: int8 codes by all_to_all; qwZ: int8 codes all-gathered. No large fp32 collective.
    assert payloads(texts["int8"]) == {("all-to-all", ("s8",)), ("all-gather", ("s8",))}
    # Ring model: scatter + gather costs what one all-reduce does; int8 about 4x less.
    full = 2 * (N - 1) / N * 4 * numel
    assert wire_bytes(texts["plain"]) == pytest.approx(full, rel=1e-3)
    assert wire_bytes(texts["exact"]) == pytest.approx(full, rel=2e-3)
    ratio = wire_bytes(texts["exact"]) / wire_bytes(texts["int8"])
    assert 3.8 < ratio < 4.0, ratio


def qwz_gather_reference(master: dict, like: dict, n: int, block_size: int = 2048) -> dict:
    """NumPy model of the int8 all-gather of one bucket: every row quantized blockwise."""
    names = sorted(like)  # jax.tree order of a dict
    rows = np.concatenate([np.asarray(master[k]).reshape(n, -1) for k in names], axis=1)
    c_total = rows.shape[1]
    blocks, length = layout(c_total, block_size, 8)
    padded = np.pad(rows, ((0, 0), (0, blocks * length - c_total))).reshape(n, blocks, length)
    deq = dequantize(*quantize(padded, 8)).reshape(n, -1)[:, :c_total]
    out, offset = {}, 0
    for k in names:
        c = -(-like[k].size // n)
        out[k] = deq[:, offset : offset + c].reshape(-1)[: like[k].size].reshape(like[k].shape)
        offset += c
    return out


def test_int8_gradients_and_weights_train_and_keep_exact_masters(mesh):
    params, _ = problem()
    inner = optax.adamw(3e-2, weight_decay=0.1)
    tx = jc.sharded(
        inner,
        "dp",
        compressor=jc.Quantize(bits=8, error_feedback=True),
        gather_compressor=jc.Quantize(bits=8),
    )
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    assert state.opt_state.comm.buckets[0].worker_error.shape[0] == N  # per device EF
    losses = []
    for batch in batches(steps=30):
        state, loss = step(state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < losses[0] - 0.05
    # The replicated parameters are exactly the int8 gather of the per-device master shards.
    master = state.opt_state.master.shards  # (n, c) per leaf, row r on device r
    assert np.all(np.asarray(state.opt_state.master.valid))
    expected = qwz_gather_reference(master, params, N)
    assert_close(state.params, expected, rtol=1e-6, atol=1e-6)
    # ... and the masters are not the quantized parameters (updates below a step survive).
    sliced = jax.tree.map(np.asarray, shard_of(state.params, 0, N))
    assert any(
        np.max(np.abs(np.asarray(m)[0] - s)) > 0
        for m, s in zip(jax.tree.leaves(master), jax.tree.leaves(sliced), strict=True)
    )
    # Close to the exact run after 30 steps (int8 error is small).
    reference = full_batch_optax(inner, params, batches(steps=30))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference), strict=True):
        assert np.max(np.abs(np.asarray(a) - np.asarray(b))) < 0.05


def test_init_outside_the_axis_and_errors(mesh):
    params, _ = problem()
    tx = jc.sharded(optax.adam(1e-3), "dp", axis_size=N)
    # Outside the axis (the nnx.Optimizer route): device 0's shard shapes; zeros are the same
    # for every device, so stack_per_device gives what init_opt_state builds per device.
    outside = jc.stack_per_device(tx.init(params), N)
    inside = jc.from_pmap_layout(jc.init_opt_state(tx, params, "dp", N))
    assert isinstance(outside, ShardedState)
    assert_close(outside, inside, rtol=0, atol=0)
    # A qwZ master cannot be sliced outside the axis: it is marked invalid, filled at step 1.
    qwz = jc.sharded(optax.adam(1e-3), "dp", gather_compressor=jc.Quantize(8), axis_size=N)
    assert not bool(qwz.init(params).master.valid)
    assert bool(
        jc.from_pmap_layout(jc.init_opt_state(qwz, params, "dp", N)).master.valid[0]
    )
    # An inner init that stores parameter values cannot be built for every device from outside.
    values = jc.sharded(optax.contrib.schedule_free_adamw(1e-3), "dp", axis_size=N)
    with pytest.raises(ValueError, match="stores parameter values"):
        values.init(params)
    # ... but where the axis is bound, each device gets its own shard.
    state = jc.from_pmap_layout(jc.init_opt_state(values, params, "dp", N))
    z = state.inner.z  # schedule-free keeps the parameters themselves
    np.testing.assert_array_equal(np.asarray(z["w1"]).reshape(-1)[:91], params["w1"].ravel())
    with pytest.raises(ValueError, match="needs params"):
        jax.vmap(lambda _: tx.update(params, tx.init(params)), axis_name="dp")(jnp.zeros(N))
    with pytest.raises(TypeError, match="Compressor"):
        jc.sharded(optax.adam(1e-3), "dp", compressor="int8")


def test_flax_nnx_sharded_example():
    """The NNX example: exact == plain AdamW on the full batch; int8 trains; 1/n state."""
    import importlib.util
    import pathlib

    from flax import nnx

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "flax_nnx_sharded.py"
    spec = importlib.util.spec_from_file_location("jaxcomm_example_flax_nnx_sharded", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(steps=20, log=None)
    exact, int8 = out["losses"]["exact"], out["losses"]["int8"]
    for losses in (exact, int8):
        assert np.all(np.isfinite(losses)) and np.mean(losses[-2:]) < losses[0] - 0.05
    np.testing.assert_allclose(int8, exact, rtol=0.02)  # int8 stays close to exact
    # Bytes per device from HLO: int8 scatter + gather about 4x less than the exact pair.
    assert 3.5 < out["step_bytes"]["exact"] / out["step_bytes"]["int8"] <= 4.0
    # Optimizer state per device: 1/8 of plain data parallel plus padding and counts.
    assert out["state_bytes"]["exact"] < out["plain_state_bytes"] / N + 64
    assert out["state_bytes"]["exact"] > out["plain_state_bytes"] / N

    graphdef, params = nnx.split(example.CharMLP(out["vocab"], nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(example.LR, weight_decay=example.WEIGHT_DECAY)
    opt_state = tx.init(params)

    @jax.jit
    def reference_step(params, opt_state, batch):  # one device, the whole global batch
        loss, grads = jax.value_and_grad(lambda p: example.loss_fn(nnx.merge(graphdef, p), batch))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start, losses = jax.tree.map(np.asarray, params), []
    for batch in out["batches"]:
        params, opt_state, loss = reference_step(params, opt_state, batch)
        losses.append(float(loss))
    # Only the order of the fp32 sums differs (see assert_params_close): losses to 100 eps per
    # step, the parameters over the whole tree.
    steps = len(losses)
    np.testing.assert_allclose(exact, losses, rtol=steps * 100 * EPS32)
    got = nnx.state(out["models"]["exact"], nnx.Param)
    assert_params_close(got, params, start=start, steps=steps)


def test_demo_sharded_int8_method(mesh):
    pytest.importorskip("rich")
    from jaxcomm.cli import demo_methods, demo_report, demo_run
    from jaxcomm.cli.demo_methods import EXACT, SHARDED_INT8
    from jaxcomm.cli.models import ByteBatches

    cfg = demo_methods.DemoConfig(
        steps=12, batch_per_device=2, width=32, layers=1, eval_every=6, held_out=16,
        methods=("sharded_int8",),
    )
    data = ByteBatches.from_corpus(context=cfg.context)
    result = demo_run.train("sharded_int8", cfg, mesh, data)
    assert result.kinds == [SHARDED_INT8] * cfg.steps
    assert np.all(np.isfinite(result.losses)) and result.losses[-1] < result.losses[0]
    params = demo_methods.make_model(cfg).init(cfg.seed)
    per_kind = demo_methods.wire_bytes_per_kind(mesh, "dp", params, cfg.bucket_bytes)
    # int8 codes both ways (+ one fp32 scale per block and leaf): about 4x less than fp32.
    assert 3.5 < per_kind[EXACT] / per_kind[SHARDED_INT8] <= 4.0
    row = demo_report.summarize([result], per_kind)[0]
    assert row["total_bytes"] == pytest.approx(cfg.steps * per_kind[SHARDED_INT8])
    assert row["steps"][SHARDED_INT8] == cfg.steps
