"""DeMo (jc.demo) through jc.make_train_step on 8 devices against the NumPy model
(tests/reference/demo_reference.py): momenta and parameters over several steps, bf16 parameters,
the wire cost of a kept value from the compiled HLO, a skipped non-finite step, bad settings.

The loss is linear in the parameters (``sum(p * x)``), so each device's gradient is its batch
row exactly and the momenta do not depend on the parameters: a sign that fp32 rounding flips
(where ``|U|`` is at rounding level) moves one parameter by ``2 lr`` and nothing else."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcomm as jc
from jaxcomm.inspect import collectives_in_hlo, wire_bytes, wire_bytes_by_axes
from jaxcomm.optim.demo import message_bytes
from tests.conftest import NUM_DEVICES
from tests.reference.demo_reference import DemoModel, tiles
from tests.reference.offsets_reference import offset_bits

N = NUM_DEVICES
EPS = float(np.finfo(np.float32).eps)
# A matrix of 2x2 tiles of 64x48, a 3-D leaf (viewed as 12 x 40: one tile), a vector (chunks
# of 35) and a scalar.
SHAPES = {"w": (128, 96), "k": (12, 5, 8), "b": (70,), "s": ()}
LR, BETA, TOP_K, WD = 2.0**-6, 0.9, 16, 0.1


def loss_fn(p, x):
    return sum(jnp.sum(p[k] * jnp.mean(x[k], axis=0)) for k in p)


@functools.cache
def compiled(dtype=jnp.float32, weight_decay=WD, shapes=None, **kw):
    """``(step, initial state)``, compiled once per setting (``shapes``: a tuple of ``(name,
    shape)``, default ``SHAPES``). The step donates its input state: use :func:`fresh`."""
    shapes = tuple(SHAPES.items()) if shapes is None else shapes
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = jc.demo(
        LR, axis_name="dp", compression_decay=BETA, top_k=TOP_K, weight_decay=weight_decay, **kw
    )
    rng = np.random.default_rng(42)
    params = {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes}
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    return step, state


def fresh(**kw):
    step, state = compiled(**kw)
    return step, jax.tree.map(jnp.copy, state)


def batch(seed, shapes=SHAPES):
    """Each device's gradient, rounded to bf16 values (so bf16 parameters see them exactly)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, s in shapes.items():
        x = rng.normal(size=(N, *s)).astype(ml_dtypes.bfloat16)
        out[k] = x.astype(np.float32)
    return out


def numpy_tree(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def check_params(got, want, u, t, atol):
    """Parameters equal to ``atol``, except where the model's ``|U|`` is at rounding level
    (``<= 1e-5 max|U|``: the fp32 DCTs' error is far below), which may differ by ``2 lr`` a step."""
    for name in SHAPES:
        g = np.asarray(got[name], np.float64)
        w = np.asarray(want[name], np.float64)
        flat_u = np.abs(u[name]).reshape(-1)
        ambiguous = flat_u <= 1e-5 * max(flat_u.max(), 1e-30)
        assert ambiguous.mean() < 0.01, name  # the comparison stays meaningful
        diff = np.abs(g - w).reshape(-1)
        np.testing.assert_array_less(diff[~ambiguous], atol, err_msg=name)
        assert np.all(diff[ambiguous] <= atol + 2 * LR * t), name


def test_steps_match_the_model():
    step, state = fresh()
    model = DemoModel(N, SHAPES, LR, beta=BETA, top_k=TOP_K, wd=WD)
    want = numpy_tree(state.params)
    for t in range(1, 4):
        x = batch(t)
        state, _ = step(state, x)
        want, u = model.step(want, x)
        # Momenta are O(0.1): each step's DCT, top-k removal and inverse DCT round in fp32 over
        # sums of h + w terms; the errors add up over the steps.
        for name, shape in SHAPES.items():
            _, _, h, w = tiles(shape, 64)
            m = np.asarray(state.opt_state.local.mu[name])
            scale = model.scale[name]
            np.testing.assert_allclose(
                m, model.m[name], rtol=0, atol=(h + w) * EPS * scale * t, err_msg=name
            )
        # Parameters O(3): a weight-decay product and a sum a step, rounded differently.
        check_params(state.params, want, u, t, atol=4 * EPS * 4.0 * t)
    assert int(state.opt_state.count) == 3 and int(state.opt_state.skips.total) == 0


def test_bf16_parameters():
    step, state = fresh(dtype=jnp.bfloat16, weight_decay=0.0)
    model = DemoModel(N, SHAPES, LR, beta=BETA, top_k=TOP_K)
    want = numpy_tree(state.params)
    for t in range(1, 3):
        x = batch(10 + t)
        state, _ = step(state, x)
        want, u = model.step(want, x)
        assert all(v.dtype == jnp.bfloat16 for v in state.params.values())
        assert all(v.dtype == jnp.float32 for v in state.opt_state.local.mu.values())
        # lr = 2^-6: p - lr sign(U) is one bf16 rounding, the same in the model.
        check_params(state.params, want, u, t, atol=1e-30)


# A 64x64 tile keeping 16: Elias-Fano offsets, 16 x 9 + 16 bits (10 a value); a vector chunk of
# 64 keeping 16: a 64-bit mask (4 a value). Then the value in fp32 or bf16.
@pytest.mark.parametrize(
    "shape, value_dtype, per_value",
    [
        ((64, 64), jnp.float32, 5.25),
        ((64, 64), jnp.bfloat16, 3.25),
        ((64,), jnp.float32, 4.5),
        ((64,), jnp.bfloat16, 2.5),
    ],
)
def test_one_kept_value_costs_its_offset_code_and_its_value_on_the_wire(
    shape, value_dtype, per_value
):
    """One all-gather of uint8; each extra chunk's kept values cost their offsets' code
    (``offset_bits`` of the NumPy model) and their values."""
    measured = {}
    for rows in (1, 2):  # 1 or 2 chunks: 16 or 32 kept values
        shapes = (("w", (rows * shape[0], *shape[1:])),)
        step, state = fresh(shapes=shapes, value_dtype=value_dtype)
        text = step.lower(state, batch(0, dict(shapes))).compile().as_text()
        gathers = [op for op in collectives_in_hlo(text) if op.op == "all-gather"]
        assert [op.dtypes for op in gathers] == [("u8",)]
        others = [op for op in collectives_in_hlo(text) if op.op != "all-gather"]
        assert all(op.payload_bytes <= 4 for op in others)  # the loss mean
        length = 64 * 64 if len(shape) == 2 else 64
        size = np.dtype(value_dtype).itemsize
        want = -(-rows * offset_bits(length, TOP_K) // 8) + rows * TOP_K * size
        assert gathers[0].wire_bytes == (N - 1) * want
        assert want == message_bytes([shapes[0][1]], top_k=TOP_K, value_dtype=value_dtype)
        measured[rows] = wire_bytes(text)
    assert (measured[2] - measured[1]) / (N - 1) / TOP_K == per_value


def test_nonfinite_step_is_skipped():
    """A NaN in one device's gradient reaches every device's gathered values: nothing moves,
    the momenta are kept, the skip is counted; the next step is what it would have been."""
    step, s0 = fresh()
    s1, _ = step(s0, batch(1))
    keep = jax.tree.map(jnp.copy, s1)  # on the mesh as placed (NumPy copies would recompile)
    bad = batch(2)
    bad["w"][3, 5, 7] = np.nan
    s2, _ = step(jax.tree.map(jnp.copy, keep), bad)
    for a, b in zip(jax.tree.leaves(keep.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(
        jax.tree.leaves(keep.opt_state.local), jax.tree.leaves(s2.opt_state.local), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(s2.opt_state.skips.consecutive) == 1 and int(s2.opt_state.skips.total) == 1
    assert int(s2.opt_state.count) == 1
    after_skip, _ = step(s2, batch(3))
    direct, _ = step(keep, batch(3))
    for a, b in zip(
        jax.tree.leaves(after_skip.params), jax.tree.leaves(direct.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(after_skip.opt_state.skips.consecutive) == 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"top_k": 0}, "top_k must be an int >= 1"),
        ({"chunk_size": 65}, "chunk_size must be an int in [1, 64]"),
        ({"compression_decay": 1.0}, "compression_decay must be in [0.0, 1.0)"),
        ({"compression_decay": -0.1}, "compression_decay must be in [0.0, 1.0)"),
        ({"weight_decay": -1.0}, "weight_decay must be in [0.0, inf]"),
        ({"value_dtype": jnp.int8}, "value_dtype must be float32, bfloat16 or float16"),
    ],
)
def test_bad_settings_are_refused_in_one_sentence(kwargs, words):
    with pytest.raises(ValueError, match=re.escape("jaxcomm: demo " + words)):
        jc.demo(1e-3, axis_name="dp", **kwargs)


def test_integer_parameters_are_refused():
    tx = jc.demo(1e-3, axis_name="dp")
    with pytest.raises(ValueError, match=r"needs floating-point parameters, got int32 at \['n'\]"):
        tx.init({"w": jnp.zeros(4), "n": jnp.zeros(3, jnp.int32)})


def test_comms_report_shows_the_gathered_parts_at_their_analytic_cost():
    """jc.comms_report of the step: one uint8 all-gather (nothing flagged against a uint8
    payload) whose wire bytes are the analytic count, the offsets' code (the NumPy model's) +
    4 bytes per kept value (chunks counted from the reference's tiling), to each of the n - 1
    others."""
    step, state = fresh()
    report = jc.comms_report(step, state, batch(0), expect="uint8")
    assert report.ok, str(report)
    gathers = [r for r in report.rows if r.op == "all-gather"]
    assert [(r.dtype, r.count) for r in gathers] == [("u8", 1)]
    kept = bits = 0
    for shape in SHAPES.values():
        rows, cols, h, w = tiles(shape, 64)
        chunks, k = (rows // h) * (cols // w), min(TOP_K, h * w)
        kept += chunks * k
        bits += chunks * offset_bits(h * w, k)
    assert gathers[0].wire_bytes == (N - 1) * (-(-bits // 8) + 4 * kept)
    # Everything else is the loss mean and the skip counters: a few bytes.
    assert report.wire_bytes - gathers[0].wire_bytes <= 64


def test_reshard_averages_the_momenta_and_continues_as_the_model():
    """jc.reshard_train_state from 8 to 4 devices: parameters and counters are kept; every new
    device's momentum is the mean of the old ones (each device's untransmitted residual
    weighs ``1/n`` in the gathered mean, so their mean is what the restart must keep); the next
    step on 4 devices is the NumPy model's from those momenta."""
    step, state = fresh()
    model = DemoModel(N, SHAPES, LR, beta=BETA, top_k=TOP_K, wd=WD)
    want = numpy_tree(state.params)
    for t in (1, 2):
        state, _ = step(state, batch(20 + t))
        want, _ = model.step(want, batch(20 + t))
    m = 4
    mesh = jax.make_mesh(
        (m,), ("dp",), devices=jax.devices()[:m], axis_types=(jax.sharding.AxisType.Auto,)
    )
    tx = jc.demo(LR, axis_name="dp", compression_decay=BETA, top_k=TOP_K, weight_decay=WD)
    out = jc.reshard_train_state(
        state, tx, state.params, axis_name="dp", new_axis_size=m, mesh=mesh
    )
    for name in SHAPES:
        np.testing.assert_array_equal(np.asarray(out.params[name]), np.asarray(state.params[name]))
        old = np.asarray(state.opt_state.local.mu[name], np.float64)
        got = np.asarray(out.opt_state.local.mu[name])
        assert got.shape == (m, *SHAPES[name])
        mean = old.mean(axis=0).astype(np.float32)  # one rounding of the float64 mean
        for r in range(m):
            np.testing.assert_array_equal(got[r], mean, err_msg=name)
    assert int(out.opt_state.count) == 2 and int(out.opt_state.skips.total) == 0

    model4 = DemoModel(m, SHAPES, LR, beta=BETA, top_k=TOP_K, wd=WD)
    model4.m = {k: np.repeat(np.asarray(out.opt_state.local.mu[k])[:1], m, 0) for k in SHAPES}
    params = {k: jnp.asarray(v) for k, v in want.items()}
    step4, _ = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    x = {k: v[:m] for k, v in batch(23).items()}
    state4, _ = step4(out, x)
    want, u = model4.step(numpy_tree(state.params), x)
    for name in SHAPES:
        _, _, h, w = tiles(SHAPES[name], 64)
        np.testing.assert_allclose(
            np.asarray(state4.opt_state.local.mu[name]), model4.m[name], rtol=0,
            atol=(h + w) * EPS * model4.scale[name], err_msg=name,
        )  # fmt: skip
    check_params(state4.params, want, u, 1, atol=4 * EPS * 4.0)


def test_over_a_tuple_of_axes_a_replica_is_a_node():
    """``axis_name=("host", "local")`` on a 2 x 4 mesh: each node steps on the exact mean of its
    4 devices' gradients, as the NumPy model of 2 replicas does; a node's devices keep the same
    momentum; across ``host`` each device sends 1/4 of its node's message (and the loss mean)."""
    S, L = 2, 4
    axes = ("host", "local")
    mesh = jax.make_mesh((S, L), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = jc.demo(LR, axis_name=axes, compression_decay=BETA, top_k=TOP_K, weight_decay=WD)
    rng = np.random.default_rng(42)
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
    step, state = jc.make_train_step(mesh, axes, loss_fn, tx, params)
    text = step.lower(state, batch(0)).compile().as_text()
    across = sum(v for k, v in wire_bytes_by_axes(text, mesh).items() if "host" in k)
    piece = -(-message_bytes(SHAPES.values(), top_k=TOP_K) // L)
    assert (S - 1) * piece <= across <= (S - 1) * piece + 64, across
    model = DemoModel(S, SHAPES, LR, beta=BETA, top_k=TOP_K, wd=WD)
    want = numpy_tree(state.params)
    for t in range(1, 4):
        x = batch(t)
        state, _ = step(state, x)
        nodes = {
            k: v.reshape(S, L, *v.shape[1:]).astype(np.float64).mean(1).astype(np.float32)
            for k, v in x.items()
        }
        want, u = model.step(want, nodes)
        for name, shape in SHAPES.items():
            _, _, h, w = tiles(shape, 64)
            m = np.asarray(state.opt_state.local.mu[name]).reshape(S, L, *shape)
            for s in range(S):
                for i in range(1, L):
                    np.testing.assert_array_equal(m[s, i], m[s, 0], err_msg=name)
            np.testing.assert_allclose(
                m[:, 0], model.m[name], rtol=0, atol=(h + w) * EPS * model.scale[name] * t,
                err_msg=name,
            )  # fmt: skip
        check_params(state.params, want, u, t, atol=4 * EPS * 4.0 * t)
    assert int(state.opt_state.skips.total) == 0
