"""Property tests (hypothesis) over random trees, axis sizes, bucket sizes and compressors.

Trees mix scalars, zero-size and small leaves of f32, bf16, f16, int32 and bool. For every
example one compiled program runs two compressed psums (threading the state), a compressed
reduce-scatter, its all-gather and a psum of all-zero input, and the test checks:

* ``NoCompression`` equals the exact sum (NumPy, float64), integers and bools bit for bit;
* error feedback: ``psum_out + T_new == sum_r x_r + T_old`` per compressed bucket, where ``T``
  is the pending sum of the per-device states (``Compressor.pending_sum``);
* the all-gather of the scatter's shards puts every device's shard back where it came from
  (and, for ``NoCompression``, gives the exact sum);
* every output keeps the dtype ``lax.psum`` / ``lax.pmean`` would give;
* all-zero input gives exact zeros and a finite state (no ``0/0`` scales).

Examples are few and small: each one costs a compilation.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.compressors.buckets import plan_buckets
from tests.conftest import make_mesh

DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.int32),
          np.dtype(np.bool_)]
SHAPES = [(), (0,), (3,), (2, 3), (4, 5), (1, 0, 2), (7,)]
COMPRESSORS = [
    jc.NoCompression(),
    jc.OneBit(),
    jc.Quantize(bits=8, block_size=4, error_feedback=True),
    jc.Quantize(bits=4, block_size=4, error_feedback=True),
    jc.Cast(jnp.bfloat16, error_feedback=True),
    jc.Cast(jnp.float16, error_feedback=True),
    jc.TopK(fraction=0.3),
    jc.PowerSGD(rank=1, min_compression_rate=1.0),
]
EPS = {np.dtype(np.float32): 2.0**-23, np.dtype(jnp.bfloat16): 2.0**-8,
       np.dtype(np.float16): 2.0**-10}

leaves = st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)), min_size=1,
                  max_size=3)
# Every example compiles a program (seconds on 2 cores): few examples, no shrinking (a failure
# is reported as drawn), plus one explicit example per compressor with every dtype and the
# scalar and zero-size shapes.
PROPS = settings(max_examples=6, deadline=None, derandomize=True,
                 phases=[Phase.explicit, Phase.generate],
                 suppress_health_check=[HealthCheck.too_slow])
MIXED = [((), np.dtype(np.float32)), ((0,), np.dtype(jnp.bfloat16)), ((4, 5), np.dtype(np.float16)),
         ((3,), np.dtype(np.int32)), ((2, 3), np.dtype(np.bool_)), ((7,), np.dtype(jnp.bfloat16))]


def make_data(spec, n, seed):
    rng = np.random.default_rng(seed)
    tree = {}
    for i, (shape, dtype) in enumerate(spec):
        if dtype == np.bool_:
            x = rng.random((n, *shape)) < 0.5
        elif dtype == np.int32:
            x = rng.integers(-50, 50, (n, *shape))
        else:
            x = rng.normal(size=(n, *shape))
        tree[f"l{i}"] = np.asarray(x).astype(dtype)
    return tree


def build(spec, n, comp, bucket_bytes):
    like = {f"l{i}": jax.ShapeDtypeStruct(s, d) for i, (s, d) in enumerate(spec)}
    s_ar = jc.init_state(comp, like, axis_size=n, bucket_bytes=bucket_bytes)
    s_rs = jc.init_state(comp, like, axis_size=n, bucket_bytes=bucket_bytes, op="reduce_scatter")
    kw = dict(axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes)

    def body(x, y, s_ar, s_rs):
        x, y = (jax.tree.map(lambda v: v[0], t) for t in (x, y))
        o1, s1 = jc.compressed_psum(x, s_ar, **kw)
        o2, s2 = jc.compressed_psum(y, s1, **kw)
        rows, _ = jc.compressed_psum_scatter(x, s_rs, **kw)
        full, _ = jc.compressed_all_gather(
            rows, None, axis_name="dp", compressor=jc.NoCompression(), like=rows_like(rows, x),
            bucket_bytes=bucket_bytes,
        )
        return (o1, o2, full), (s1, s2), rows

    def rows_like(rows, x):
        return jax.tree.map(lambda r, v: jax.ShapeDtypeStruct(v.shape, r.dtype), rows, x)

    spec_dp = P("dp")
    fn = jax.jit(jax.shard_map(
        body, mesh=make_mesh(n), in_specs=(spec_dp, spec_dp, spec_dp, spec_dp),
        out_specs=(P(), spec_dp, spec_dp),
    ))
    glob = lambda s: jc.stack_per_device(s, n)  # noqa: E731
    return fn, glob(s_ar), glob(s_rs), like


def psum_dtype(dtype):
    return np.dtype(np.int32) if dtype == np.bool_ else np.dtype(dtype)


def tolerance(dtype, n, magnitude):
    return (n + 2) * EPS.get(np.dtype(dtype), 0.0) * magnitude + (1e-5 if dtype in EPS else 0)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
@PROPS
@given(spec=leaves, n=st.integers(1, 8), bucket_bytes=st.sampled_from([None, 24, 64]),
       seed=st.integers(0, 2**16))
@example(spec=MIXED, n=3, bucket_bytes=None, seed=0)
def test_collective_properties(comp, spec, n, bucket_bytes, seed):
    fn, s_ar, s_rs, like = build(spec, n, comp, bucket_bytes)
    x, y = make_data(spec, n, seed), make_data(spec, n, seed + 1)
    (o1, o2, full), (s1, s2), rows = jax.tree.map(np.asarray, fn(x, y, s_ar, s_rs))
    zeros = jax.tree.map(np.zeros_like, x)  # same program: no new compilation
    (oz, _, _), (sz, _), _ = jax.tree.map(np.asarray, fn(zeros, zeros, s_ar, s_rs))

    for k, v in x.items():
        want_dtype = psum_dtype(v.dtype)
        for out in (o1, o2, full, oz):
            assert out[k].dtype == want_dtype and out[k].shape == v.shape[1:], k
        assert rows[k].dtype == want_dtype and rows[k].shape == (n * -(-v[0].size // n),)
        # Round trip: the gathered leaf is every device's shard, in rank-major order. (Lossy
        # compressors may leave non-zero values in a shard's padding past the leaf's end.)
        np.testing.assert_array_equal(full[k].reshape(-1), rows[k][: v[0].size])
        # Zero input: exact zeros.
        np.testing.assert_array_equal(oz[k], 0)
        exact = v.astype(np.float64 if v.dtype in EPS else np.int64).sum(0)
        if v.dtype not in EPS or isinstance(comp, jc.NoCompression):
            for out in (o1, full):
                np.testing.assert_allclose(
                    out[k].astype(np.float64), exact, rtol=0,
                    atol=tolerance(v.dtype, n, np.abs(v).astype(np.float64).sum(0).max(initial=0)),
                )
    for state in jax.tree.leaves((s1, s2, sz)):
        assert np.isfinite(state).all()
    if jax.tree.leaves(s1):
        assert not np.asarray(sz.nonfinite).any() and not np.asarray(s2.nonfinite).any()

    # Error feedback: out + T_new == sum_r y_r + T_old, bucket by bucket, in real coordinates.
    names = list(x)  # tree order of a dict with keys l0..l{k}: sorted, as written
    buckets = plan_buckets([like[k] for k in names], bucket_bytes, comp.compute_dtype)
    for b, bucket in enumerate(buckets):
        if bucket.exact or bucket.numel == 0 or not jax.tree.leaves(s1.buckets[b]):
            continue
        per_dev = lambda s, b=b: [  # noqa: E731
            jax.tree.map(lambda a, r=r: a.reshape(n, -1)[r], s.buckets[b]) for r in range(n)
        ]
        t_old = comp.pending_sum(per_dev(s1), bucket, "all_reduce")
        t_new = comp.pending_sum(per_dev(s2), bucket, "all_reduce")
        keys = [names[i] for i in bucket.leaf_ids]
        out = np.concatenate([o2[k].astype(np.float64).reshape(-1) for k in keys])
        inp = np.concatenate([y[k].astype(np.float64).sum(0).reshape(-1) for k in keys])
        tol = np.concatenate([
            np.full(y[k][0].size, tolerance(y[k].dtype, 1, 1.0)) for k in keys
        ]) * (np.abs(out) + 1) * 4 + 1e-4 * math.sqrt(n)
        np.testing.assert_array_less(np.abs(out + t_new - (inp + t_old)), tol)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(spec=leaves, bucket_bytes=st.sampled_from([None, 1, 16, 4096]))
def test_pmean_dtypes_match_lax(comp, spec, bucket_bytes):
    """Traced only (cheap): every output has lax.pmean's / lax.psum's dtype and shape."""
    n = 4
    fn_mesh = make_mesh(n)
    like = {f"l{i}": jax.ShapeDtypeStruct((n, *s), d) for i, (s, d) in enumerate(spec)}
    local = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in like.items()}
    state = jc.init_state(comp, local, axis_size=n, bucket_bytes=bucket_bytes)
    gstate = jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), state)

    def body(x, s):
        x = jax.tree.map(lambda v: v[0], x)
        got, _ = jc.compressed_pmean(x, s, axis_name="dp", compressor=comp,
                                     bucket_bytes=bucket_bytes)
        # lax.pmean refuses bool; its documented behaviour is the mean of int32 counts.
        want = jax.tree.map(
            lambda v: lax.pmean(v.astype(jnp.int32) if v.dtype == jnp.bool_ else v, "dp"), x
        )
        return got, want

    got, want = jax.eval_shape(
        jax.shard_map(body, mesh=fn_mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P())),
        like, gstate,
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
