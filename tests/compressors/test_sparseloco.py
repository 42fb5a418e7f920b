"""SparseLoCo (jc.SparseLoCo): compression, aggregation and error feedback against the NumPy
model (tests/reference/sparseloco_reference.py), its wire cost from the compiled HLO, bad input, the
non-finite guard, and DiLoCo's outer compression inside jc.make_train_step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.inspect import collectives_in_hlo, wire_bytes
from tests.conftest import NUM_DEVICES
from tests.reference.offsets_reference import offset_bits
from tests.reference.sparseloco_reference import SparseLoCoModel

N = NUM_DEVICES
EPS = float(np.finfo(np.float32).eps)
# A matrix of 2x2 tiles of 64x48, a 3-D leaf (viewed as 12 x 40: tiles of 12x40), a vector
# (chunks of 35) and a scalar.
SHAPES = {"w": (128, 96), "k": (12, 5, 8), "b": (70,), "s": ()}


def make_step(mesh, comp, shapes=SHAPES):
    local = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    state = jc.stack_per_device(jc.init_state(comp, local, axis_size=N), N)

    def body(tree, s):
        return jc.compressed_pmean(
            jax.tree.map(lambda x: x[0], tree), s, axis_name="dp", compressor=comp
        )

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )
    return fn, state


def data(seed, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in shapes.items()}


def errors(state, shapes=SHAPES):
    """Per leaf, every device's error ``(n, size)``, from the one bucket's state."""
    flat = np.asarray(state.buckets[0].error).reshape(N, -1)
    out, start = {}, 0
    for name in sorted(shapes):  # the tree's leaf order (dict keys sorted)
        size = int(np.prod(shapes[name]))
        out[name] = flat[:, start : start + size]
        start += size
    return out


@pytest.mark.parametrize("aggregate", ["contributors", "all"])
def test_mean_and_error_feedback_match_the_model(mesh, aggregate):
    comp = jc.SparseLoCo(top_k=64, error_decay=0.9, aggregate=aggregate)
    model = SparseLoCoModel(N, SHAPES, top_k=64, error_decay=0.9, aggregate=aggregate)
    step, state = make_step(mesh, comp)
    steps = 3
    for t in range(steps):
        x = data(t)
        out, state = step(x, state)
        want = model.step(x)
        # Kept values and errors are O(3); a few fp32 roundings per step, compounding over steps.
        tol = 8 * (t + 1) * EPS * 4.0
        for name in SHAPES:
            np.testing.assert_allclose(np.asarray(out[name]), want[name], rtol=0, atol=tol)
            np.testing.assert_allclose(
                errors(state)[name], model.error[name], rtol=0, atol=tol, err_msg=name
            )
    # Sparse: no more than n k entries per chunk are nonzero, and the scalar is sent exactly.
    assert 0 < np.count_nonzero(out["w"]) <= N * 4 * 48
    assert np.count_nonzero(out["b"]) <= N * 2


def test_error_feedback_identity(mesh):
    """``beta = 1``, mean over all: ``sum_r (x_r + e_r) == n mean + sum_r e_r'``."""
    comp = jc.SparseLoCo(top_k=16, error_decay=1.0, aggregate="all")
    step, state = make_step(mesh, comp)
    for t in range(3):
        x = data(10 + t)
        before = errors(state)
        out, state = step(x, state)
        after = errors(state)
        for name in SHAPES:
            lhs = x[name].reshape(N, -1).astype(np.float64).sum(0) + before[name].sum(0)
            rhs = N * np.asarray(out[name], np.float64).reshape(-1) + after[name].sum(0)
            np.testing.assert_allclose(lhs, rhs, rtol=0, atol=4 * N * EPS * (t + 2) * 4.0)


def test_one_kept_value_costs_10_bits_on_the_wire(mesh):
    """One all-gather of uint8; from the HLO, each extra kept value costs 8 + 2 bits per peer
    (64 of 4096 offsets in Elias-Fano: 64 x 7 + 64 bits)."""
    comp = jc.SparseLoCo(top_k=64)
    measured = {}
    for rows in (64, 128):  # 1 or 2 tiles of 64x64: 64 or 128 kept values, one leaf each
        shapes = {"w": (rows, 64)}
        step, state = make_step(mesh, comp, shapes)
        text = step.lower(data(0, shapes), state).compile().as_text()
        ops = collectives_in_hlo(text)
        assert [(op.op, op.dtypes) for op in ops] == [("all-gather", ("u8",))]
        assert wire_bytes(text) == (N - 1) * comp.message_bytes([shapes["w"]])
        measured[rows] = wire_bytes(text)
    per_value = (measured[128] - measured[64]) / (N - 1) / 64
    assert per_value == 1.25  # bytes: an 8-bit offset and a 2-bit code
    # 64 values: 64 bytes of offsets, 16 of codes, 20 of shift and codebook.
    assert offset_bits(4096, 64) == 512
    assert measured[64] == (N - 1) * (64 + 16 + 20)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"top_k": 0}, "top_k must be an int >= 1"),
        ({"chunk_size": 65}, "chunk_size must be an int in [1, 64]"),
        ({"bits": 3}, "bits must be 1, 2, 4 or 8"),
        ({"error_decay": 1.5}, "error_decay must be in [0, 1]"),
        ({"quant_range": 0.0}, "quant_range must be > 0"),
        ({"aggregate": "sum"}, "aggregate must be 'contributors' or 'all'"),
    ],
)
def test_bad_settings_are_refused_in_one_sentence(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        jc.SparseLoCo(**kwargs)


def test_reduce_scatter_is_refused():
    with pytest.raises(ValueError, match="is an all-reduce"):
        jc.init_state(jc.SparseLoCo(), {"w": jnp.zeros((8, 8))}, axis_size=N, op="reduce_scatter")


def test_nonfinite_step_keeps_the_state(mesh):
    """A NaN on one device reaches every device's output; no state changes and the call is
    counted; the next finite step is what it would have been without the NaN step."""
    comp = jc.SparseLoCo(top_k=32)
    step, s0 = make_step(mesh, comp)
    _, s1 = step(data(1), s0)
    bad = data(2)
    bad["w"][3, 5, 7] = np.nan
    out, s2 = step(bad, s1)
    # Device 3's shift carries the NaN into every entry it sent, on every device.
    assert np.isnan(np.asarray(out["w"])).sum() >= comp.plans([SHAPES["w"]])[0].kept
    for a, b in zip(jax.tree.leaves(s1.buckets), jax.tree.leaves(s2.buckets), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(s2.nonfinite).reshape(-1).tolist() == [1] * N
    clean, _ = step(data(3), s1)
    again, _ = step(data(3), s2)
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_diloco_outer_compression_in_make_train_step(mesh):
    """DiLoCo with SparseLoCo outer gradients, ``H = 2``, inner ``sgd(0.5)`` on a loss whose
    gradient is the device's batch: the pseudo-gradient of a round is ``0.5 (g1 + g2)`` from
    the shared start, and ``theta`` moves by the model's compressed mean (outer ``sgd(1)``)."""
    shapes = {"w": (64, 128)}
    comp = jc.SparseLoCo(top_k=64, error_decay=0.95)
    tx = jc.diloco(optax.sgd(0.5), optax.sgd(1.0), sync_every=2, axis_name="dp", compressor=comp)

    def loss_fn(p, x):
        return jnp.mean(jnp.einsum("ij,bij->b", p["w"], x))

    params = {"w": jnp.zeros(shapes["w"], jnp.float32)}
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    model = SparseLoCoModel(N, shapes, top_k=64, error_decay=0.95)
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(N, *shapes["w"])).astype(np.float32) for _ in range(2)]
    state, _ = step(state, batches[0])
    state, _ = step(state, batches[1])
    theta = np.asarray(jc.diloco_params(state.opt_state)["w"])
    want = -model.step({"w": (batches[0] + batches[1]) * np.float32(0.5)})["w"]
    # Pseudo-gradients 0.5 (g1 + g2), one rounding as the model's; kept values are O(4).
    np.testing.assert_allclose(theta, want, rtol=0, atol=16 * EPS * 8.0)
    assert np.count_nonzero(theta) <= N * 2 * 64


def _linear_loss(p, x):
    """Each device's gradient is its batch row exactly (``x`` ``(1, 64, 128)`` per device)."""
    return jnp.mean(jnp.einsum("ij,bij->b", p["w"], x))


def _sparseloco_diloco(mesh, params, specialize_phases=True):
    comp = jc.SparseLoCo(top_k=64, error_decay=0.95)
    tx = jc.diloco(optax.sgd(0.5), optax.sgd(1.0), sync_every=2, axis_name="dp", compressor=comp)
    step, state = jc.make_train_step(
        mesh, "dp", _linear_loss, tx, params, specialize_phases=specialize_phases
    )
    return comp, tx, step, state


def test_diloco_comms_report_shows_the_sparse_parts_at_their_analytic_cost(mesh):
    """jc.comms_report of DiLoCo's sync program: the outer gradient leaves as one uint8
    all-gather (nothing flagged against uint8) costing the offsets' code (the NumPy model's) and
    2 bits per kept value plus 20 bytes of shift and codebook per leaf, to each of the n - 1
    others: >= 100x fewer than the fp32
    DiLoCo sync's all-reduce of the same parameters (ring: 2 (n - 1)/n x 4 bytes an element)."""
    shapes = {"w": (64, 128), "b": (128,)}
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    _, _, step, state = _sparseloco_diloco(mesh, params, specialize_phases=False)
    x = np.zeros((N, *shapes["w"]), np.float32)
    report = jc.comms_report(step, state, x, expect="uint8")
    assert report.ok, str(report)
    gathers = [r for r in report.rows if r.op == "all-gather"]
    assert [(r.dtype, r.count) for r in gathers] == [("u8", 1)]
    kept = 2 * 64 + 2 * 1  # w: 2 tiles of 64x64 keep 64 each; b: 2 chunks of 64 keep 1 each
    bits = 2 * offset_bits(4096, 64) + 2 * offset_bits(64, 1)
    analytic = -(-bits // 8) + -(-kept * 2 // 8) + 20 * 2
    assert gathers[0].wire_bytes == (N - 1) * analytic
    # The rest: the loss mean and the skip counters' int32 max, a few bytes.
    assert report.wire_bytes - gathers[0].wire_bytes <= 64
    dense = 2 * (N - 1) / N * 4 * (64 * 128 + 128)
    assert dense / (analytic * (N - 1) / N) >= 100  # per device and sync, amortized over n


def test_diloco_nonfinite_gradient_on_one_device_is_that_device_skipping(mesh):
    """A NaN gradient on device 3 at a sync step: device 3 skips its inner step (its copy and
    inner state are kept), so the step's result is bit for bit that of device 3 having a zero
    gradient (``x - 0.5 * 0 == x``), the counter aside; the error feedback stays finite."""
    params = {"w": jnp.zeros((64, 128), jnp.float32)}
    rng = np.random.default_rng(5)
    first, second = (rng.normal(size=(N, 64, 128)).astype(np.float32) for _ in range(2))
    runs = {}
    for name, bad in (("nan", np.nan), ("zero", 0.0)):
        _, _, step, state = _sparseloco_diloco(mesh, params)
        state, _ = step(state, first)
        x = second.copy()
        x[3] = bad
        runs[name], _ = step(state, x)  # step 2: the sync
    assert int(np.asarray(runs["nan"].opt_state.local.skips.total).reshape(-1)[3]) == 1
    assert int(np.asarray(runs["zero"].opt_state.local.skips.total).reshape(-1)[3]) == 0
    zero_count = jax.tree.map(lambda a: a * 0, runs["nan"].opt_state.local)
    nan_state = runs["nan"]._replace(opt_state=runs["nan"].opt_state._replace(local=zero_count))
    zero_state = runs["zero"]._replace(
        opt_state=runs["zero"].opt_state._replace(
            local=jax.tree.map(lambda a: a * 0, runs["zero"].opt_state.local)
        )
    )
    for a, b in zip(jax.tree.leaves(nan_state), jax.tree.leaves(zero_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for leaf in jax.tree.leaves(runs["nan"].opt_state.comm):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_diloco_reshard_keeps_the_mean_error_feedback_and_continues_as_the_model():
    """jc.reshard_train_state from 8 to 4 devices mid-interval: theta and the counters are
    kept, the local copies are averaged, and every new device's SparseLoCo error feedback is
    the mean of the old ones (each device's residual weighs 1/n in the mean it will be sent
    into: the pending mean is kept). The next sync on 4 devices is the NumPy model's from
    those errors."""
    shapes = {"w": (64, 128)}
    params = {"w": jnp.zeros(shapes["w"], jnp.float32)}
    mesh8 = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    comp, tx, step, state = _sparseloco_diloco(mesh8, params)
    rng = np.random.default_rng(9)
    for _ in range(3):  # a sync after step 2; step 3 is mid-interval
        state, _ = step(state, rng.normal(size=(N, *shapes["w"])).astype(np.float32))
    old_err = np.asarray(state.opt_state.comm[0].buckets[0].error, np.float64)
    old_x = np.asarray(state.params["w"], np.float64)
    theta = np.asarray(jc.diloco_params(state.opt_state)["w"])
    assert np.abs(old_err).max() > 0 and not np.allclose(old_x[0], old_x[1])
    m = 4
    mesh = jax.make_mesh(
        (m,), ("dp",), devices=jax.devices()[:m], axis_types=(jax.sharding.AxisType.Auto,)
    )
    out = jc.reshard_train_state(
        state, tx, params, axis_name="dp", new_axis_size=m, compressor=comp, mesh=mesh
    )
    err = np.asarray(out.opt_state.comm[0].buckets[0].error)
    x = np.asarray(out.params["w"])
    assert err.shape == (m, old_err.shape[1]) and x.shape == (m, *shapes["w"])
    for r in range(m):
        # Means of 8 values of O(3), summed in fp32 (copies) or float64 (errors), scaled.
        np.testing.assert_allclose(err[r], old_err.mean(0), rtol=0, atol=4 * EPS * 4.0)
        np.testing.assert_allclose(x[r], old_x.mean(0), rtol=0, atol=8 * EPS * 4.0)
    np.testing.assert_array_equal(np.asarray(jc.diloco_params(out.opt_state)["w"]), theta)
    assert int(out.opt_state.count) == 3

    step4, _ = jc.make_train_step(mesh, "dp", _linear_loss, tx, params)
    g = rng.normal(size=(m, *shapes["w"])).astype(np.float32)
    out, _ = step4(out, g)  # step 4: the sync
    model = SparseLoCoModel(m, shapes, top_k=64, error_decay=0.95)
    model.error["w"] = err.astype(np.float32).copy()
    local = x.reshape(m, -1) - np.float32(0.5) * g.reshape(m, -1)
    delta = {"w": (theta.reshape(-1) - local).reshape(m, *shapes["w"])}
    want = theta - model.step(delta)["w"]
    got = np.asarray(jc.diloco_params(out.opt_state)["w"])
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * EPS * 8.0)
    np.testing.assert_allclose(
        np.asarray(out.opt_state.comm[0].buckets[0].error), model.error["w"], rtol=0,
        atol=16 * EPS * 8.0,
    )  # fmt: skip


def test_defaults_are_the_measured_choice():
    """``SparseLoCo()``'s defaults are the settings the selection runs chose (the last one's
    ``chosen`` carries all of them), not the reference class's top-32 / 0.999."""
    import json
    import pathlib

    results = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    chosen = json.loads((results / "time_to_loss_select_outer_lr.json").read_text())["chosen"]
    comp = jc.SparseLoCo()
    assert comp.top_k == chosen["sparseloco_top_k"] == 128
    assert comp.error_decay == chosen["sparseloco_error_decay"] == 0.8
    losses = json.loads((results / "time_to_loss_select_error_decay.json").read_text())
    by_decay = losses["held_out_loss"]["sparseloco_error_decay"]
    assert min(by_decay, key=by_decay.get) == str(comp.error_decay)
