"""Error feedback moved from n to m devices keeps its pending sum (jaxcomm.elastic.resize).

The invariant is observed, not recomputed from the state: over a whole run (steps on n devices,
``resize_state``, more steps on m devices), the summed outputs plus what is still pending at the
end equal the summed inputs, ``sum_t psum_out_t + T_end == sum_t sum_r x_{t,r}``. Losing or
duplicating error feedback at the restart breaks it by the lost amount.
"""

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.compressors.buckets import plan_buckets
from tests.conftest import make_mesh

SHAPES = {"b": (5,), "w": (6, 7)}  # tree order: b, w (one fp32 bucket)
LOCAL = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}


def inputs(seed, n):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}


def make_step(comp, op, n):
    mesh = make_mesh(n)
    collective = jc.compressed_pmean if op == "all_reduce" else jc.compressed_pmean_scatter

    def body(t, s):
        return collective(jax.tree.map(lambda x: x[0], t), s, axis_name="dp", compressor=comp)

    out_spec = P() if op == "all_reduce" else P("dp")
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(out_spec, P("dp")))
    )


def run(step, op, n, gstate, seeds, totals):
    """Steps on n devices; adds inputs and outputs (sum units, real coordinates) to totals."""
    for seed in seeds:
        x = inputs(seed, n)
        out, gstate = step(x, gstate)
        for k, shape in SHAPES.items():
            got = np.asarray(out[k], np.float64)
            if op == "reduce_scatter":  # device r's (c,) slices, concatenated: leaf order
                got = got[: int(np.prod(shape))].reshape(shape)
            totals["in"][k] += x[k].astype(np.float64).sum(0)
            totals["out"][k] += n * got
    return gstate


def pending(comp, op, n, gstate):
    bucket = plan_buckets(jax.tree.leaves(LOCAL), None, comp.compute_dtype)[0]
    per_device = [jax.tree.map(lambda x, r=r: np.asarray(x)[r], gstate.buckets[0])
                  for r in range(n)]
    return comp.pending_sum(per_device, bucket, op)


def flat(tree):
    return np.concatenate([np.ravel(tree[k]) for k in SHAPES])


CASES = [
    pytest.param(jc.OneBit(), 8, 3, id="onebit-8to3"),
    pytest.param(jc.OneBit(), 3, 8, id="onebit-3to8"),
    pytest.param(jc.Quantize(bits=8, block_size=16, error_feedback=True), 8, 3, id="int8-8to3"),
    pytest.param(jc.Cast(jnp.float16, error_feedback=True), 8, 3, id="fp16-8to3"),
    pytest.param(jc.TopK(fraction=0.2), 8, 3, id="topk-8to3"),
    pytest.param(jc.TopK(fraction=0.2), 3, 8, id="topk-3to8"),
    pytest.param(jc.PowerSGD(rank=1), 8, 3, id="powersgd-8to3"),
]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize(("comp", "n", "m"), CASES)
def test_resize_preserves_the_pending_sum(comp, n, m, op):
    totals = {key: {k: np.zeros(s) for k, s in SHAPES.items()} for key in ("in", "out")}
    state = jc.init_state(comp, LOCAL, axis_size=n, op=op)
    gstate = jc.stack_per_device(state, n)
    gstate = run(make_step(comp, op, n), op, n, gstate, range(3), totals)

    before = pending(comp, op, n, gstate)
    np.testing.assert_allclose(before, flat(totals["in"]) - flat(totals["out"]), atol=1e-4)
    assert np.abs(before).max() > 5e-4  # something is pending (fp16 rounding: ~2e-3)

    resized = jc.resize_state(gstate, comp, LOCAL, axis_size=n, new_axis_size=m, op=op)
    expected = jc.stack_per_device(jc.init_state(comp, LOCAL, axis_size=m, op=op), m)
    assert jax.tree.structure(resized) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(resized), jax.tree.leaves(expected), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(pending(comp, op, m, resized), before, rtol=1e-6, atol=1e-6)

    gstate = run(make_step(comp, op, m), op, m, resized, range(3, 6), totals)
    after = pending(comp, op, m, gstate)
    np.testing.assert_allclose(after, flat(totals["in"]) - flat(totals["out"]), atol=2e-4)


def test_reset_warns_and_gives_zeros():
    comp = jc.OneBit()
    state = jax.tree.map(lambda s: np.stack([np.asarray(s) + 1] * 4),
                         jc.init_state(comp, LOCAL, axis_size=4))
    with pytest.warns(UserWarning, match="reset=True.*lost"):
        out = jc.resize_state(state, comp, LOCAL, axis_size=4, new_axis_size=2, reset=True)
    want = jc.init_state(comp, LOCAL, axis_size=2)
    for got, w in zip(jax.tree.leaves(out.buckets), jax.tree.leaves(want.buckets), strict=True):
        assert got.shape == (2, *w.shape)
        np.testing.assert_array_equal(got, 0)


class _SumState(NamedTuple):
    acc: jax.Array


class _Custom(jc.Compressor):
    """A user compressor whose state layout resize_state does not know."""

    def init_all_reduce_state(self, numel, axis_size):
        return _SumState(jnp.ones((numel * axis_size,), jnp.float32))

    def all_reduce(self, flat, state, *, axis_name, axis_size, mean):
        raise NotImplementedError

    def reduce_scatter(self, rows, state, *, axis_name, axis_size, mean):
        raise NotImplementedError


class _Residual(NamedTuple):
    error: jax.Array


class _CountedResidual(NamedTuple):
    error: jax.Array
    calls: jax.Array


@dataclass(frozen=True)
class _ScaledSign(jc.Compressor):
    """A user compressor: ``q = mean|x + e| sign(x + e)`` summed over the axis, ``e <- x + e - q``.

    ``counted``: its state also counts the calls, a leaf the default resize does not know, so
    it says itself how its state resizes (``pending_sum`` / ``with_pending``).
    """

    counted: bool = False

    def init_all_reduce_state(self, numel, axis_size):
        error = jnp.zeros((numel,), jnp.float32)
        return _CountedResidual(error, jnp.zeros((1,), jnp.int32)) if self.counted else _Residual(
            error
        )

    def all_reduce(self, flat, state, *, axis_name, axis_size):
        buf = flat + state.error.reshape(flat.shape)
        q = jnp.mean(jnp.abs(buf)) * jnp.where(buf >= 0, 1.0, -1.0)
        out = jax.lax.psum(q, axis_name)
        error = (buf - q).reshape(state.error.shape)
        if self.counted:
            return out, _CountedResidual(error, state.calls + 1)
        return out, _Residual(error)

    def reduce_scatter(self, rows, state, *, axis_name, axis_size):
        raise NotImplementedError

    def pending_sum(self, states, bucket, op):
        if not self.counted:
            return super().pending_sum(states, bucket, op)
        return sum(np.asarray(s.error, np.float64) for s in states)

    def with_pending(self, share, template, bucket, op, *, axis_size, old):
        if not self.counted:
            return super().with_pending(share, template, bucket, op, axis_size=axis_size, old=old)
        return _CountedResidual(share, np.max([np.asarray(s.calls) for s in old], axis=0))


@pytest.mark.parametrize("counted", [False, True], ids=["default-resize", "own-resize"])
@pytest.mark.parametrize(("n", "m"), [(8, 3), (3, 8)])
def test_a_compressor_defined_outside_the_library_resizes_its_own_state(counted, n, m):
    """The protocol carries the resize: no edit of jaxcomm, no warning, the pending sum kept."""
    comp, op = _ScaledSign(counted), "all_reduce"
    totals = {key: {k: np.zeros(s) for k, s in SHAPES.items()} for key in ("in", "out")}
    gstate = jc.stack_per_device(jc.init_state(comp, LOCAL, axis_size=n), n)
    gstate = run(make_step(comp, op, n), op, n, gstate, range(3), totals)
    before = pending(comp, op, n, gstate)
    # The invariant, observed: inputs minus outputs so far (NumPy, float64).
    np.testing.assert_allclose(before, flat(totals["in"]) - flat(totals["out"]), atol=1e-4)
    assert np.abs(before).max() > 1e-2

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a reset would warn
        resized = jc.resize_state(gstate, comp, LOCAL, axis_size=n, new_axis_size=m)
    shares = np.asarray(resized.buckets[0].error).reshape(m, -1)
    np.testing.assert_allclose(shares, np.broadcast_to(before / m, shares.shape), rtol=1e-6,
                               atol=1e-7)
    if counted:
        np.testing.assert_array_equal(np.asarray(resized.buckets[0].calls).reshape(-1), [3] * m)

    gstate = run(make_step(comp, op, m), op, m, resized, range(3, 6), totals)
    after = pending(comp, op, m, gstate)
    np.testing.assert_allclose(after, flat(totals["in"]) - flat(totals["out"]), atol=2e-4)


def test_unknown_state_type_is_reset_with_a_warning():
    comp = _Custom()
    state = jax.tree.map(lambda s: np.stack([np.asarray(s)] * 2),
                         jc.init_state(comp, LOCAL, axis_size=2))
    with pytest.warns(UserWarning, match="no known layout"):
        out = jc.resize_state(state, comp, LOCAL, axis_size=2, new_axis_size=4)
    assert out.buckets[0].acc.shape == (4, 47 * 4)


def test_mismatched_state_is_refused():
    comp = jc.OneBit()
    state = jax.tree.map(lambda s: np.stack([np.asarray(s)] * 4),
                         jc.init_state(comp, LOCAL, axis_size=4))
    with pytest.raises(ValueError, match="another axis_size"):
        jc.resize_state(state, comp, LOCAL, axis_size=8, new_axis_size=2)  # wrong old size
    with pytest.raises(ValueError, match="another axis_size"):
        jc.resize_state(state, comp, {"b": LOCAL["b"]}, axis_size=4, new_axis_size=2)
    with pytest.raises(ValueError, match="expected ScatterState"):
        jc.resize_state(state, comp, LOCAL, axis_size=4, new_axis_size=2, op="reduce_scatter")


def test_unresized_state_on_another_device_count_is_refused_at_trace_time():
    """Restoring an 8-device state onto 4 devices without resize_state: a clear error."""
    comp = jc.OneBit()
    gstate = jc.stack_per_device(jc.init_state(comp, LOCAL, axis_size=8), 8)
    step = make_step(comp, "all_reduce", 4)
    with pytest.raises(ValueError, match="axis 'dp' of size 4"):
        step(inputs(0, 4), gstate)
