"""Hierarchical reduction on a ("node", "local") mesh against exact collectives and NumPy models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.comm.hierarchical import hierarchical_pmean, hierarchical_psum, init_hierarchical_state
from jaxcomm.inspect import replica_groups, wire_bytes_by_axes
from tests.reference import quantize_reference as qref

S, L = 2, 4  # nodes (slow axis) x local devices (fast axis)
BOTH = ("node", "local")


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((S, L), BOTH, axis_types=(AxisType.Auto,) * 2)


def run(mesh2d, fn, tree, state):
    """``fn(local_tree, state)`` per device; tree leaves are stacked (S*L, ...) node-major."""
    spec = P(BOTH)
    mapped = jax.shard_map(
        lambda t, s: fn(jax.tree.map(lambda x: x[0], t), s),
        mesh=mesh2d,
        in_specs=(spec, spec),
        out_specs=(P(), spec),
    )
    return jax.jit(mapped)(tree, state)


def stacked(seed, shapes, dtypes=None):
    rng = np.random.default_rng(seed)
    dtypes = dtypes or {}
    out = {}
    for k, s in shapes.items():
        dt = np.dtype(dtypes.get(k, np.float32))
        if np.issubdtype(dt, np.integer):
            out[k] = rng.integers(-9, 9, size=(S * L, *s)).astype(dt)
        else:
            out[k] = rng.normal(size=(S * L, *s)).astype(np.float32).astype(dt)
    return out


def global_state(state):
    return jc.stack_per_device(state, S * L)


@pytest.mark.parametrize("mean", [False, True])
def test_exact_compressor_equals_psum_over_both_axes(mesh2d, mean):
    shapes = {"w": (6, 5), "b": (7,), "i": (3,), "h": (9,)}
    tree = stacked(0, shapes, {"i": np.int32, "h": jnp.bfloat16})
    comp = jc.NoCompression()
    collective = hierarchical_pmean if mean else hierarchical_psum
    exact = lax.pmean if mean else lax.psum

    def fn(t, s):
        out, _ = collective(t, None, inner_axis="local", outer_axis="node", compressor=comp)
        return (out, jax.tree.map(lambda x: exact(x, BOTH), t)), s

    (out, ref), _ = run(mesh2d, fn, tree, ())
    n = S * L
    for k in shapes:
        assert out[k].dtype == ref[k].dtype and out[k].shape == ref[k].shape, k
        x = np.asarray(tree[k], np.float64)
        exact_sum = x.sum(0) / (n if mean else 1)  # n is a power of two: the division is exact
        if np.issubdtype(tree[k].dtype, np.integer):
            np.testing.assert_array_equal(out[k], ref[k])
            np.testing.assert_array_equal(out[k], exact_sum.astype(out[k].dtype))
            continue
        # Any order of n - 1 additions in the leaf's dtype is within (n - 1) eps sum|x| of the
        # exact sum, plus one rounding of the result (standard summation error bound).
        eps = float(jnp.finfo(tree[k].dtype).eps)
        bound = ((n - 1) * eps * np.abs(x).sum(0) + eps * np.abs(x.sum(0))) / (n if mean else 1)
        for got in (out[k], ref[k]):
            error = np.abs(np.asarray(got, np.float64) - exact_sum)
            assert np.all(error <= bound), (k, float(np.max(error - bound)))


@pytest.mark.parametrize("mean", [False, True])
def test_integer_leaves_next_to_compressed_ones_are_exact(mesh2d, mean):
    """As compressed_psum/pmean: integer and bool leaves are reduced exactly (pmean: a floating
    mean, as lax.pmean), with a state from init_hierarchical_state of the whole tree, and they
    do not change what the floating leaves get."""
    tree = stacked(3, {"w": (300,), "i": (5,), "flag": (3,)}, {"i": np.int32})
    tree["flag"] = tree["flag"] > 0
    comp = jc.Quantize(bits=8, block_size=64, error_feedback=True)
    collective = hierarchical_pmean if mean else hierarchical_psum

    def state_for(t):
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), t)
        return global_state(init_hierarchical_state(comp, like, inner_size=L, outer_size=S))

    def fn(t, s):
        return collective(t, s, inner_axis="local", outer_axis="node", compressor=comp)

    state, alone_state = state_for(tree), state_for({"w": tree["w"]})
    for _ in range(2):  # the second step uses the returned state
        out, state = run(mesh2d, fn, tree, state)
        alone, alone_state = run(mesh2d, fn, {"w": tree["w"]}, alone_state)
        np.testing.assert_array_equal(out["w"], alone["w"])
        for k in ("i", "flag"):
            total = tree[k].astype(np.int32).sum(0)
            if mean:  # S and L are powers of two: the per-axis division is exact
                assert out[k].dtype == jnp.float32, k
                np.testing.assert_array_equal(out[k], total.astype(np.float32) / (S * L))
            else:
                assert out[k].dtype == jnp.int32, k
                np.testing.assert_array_equal(out[k], total)
        assert jax.tree.structure(state) == jax.tree.structure(state_for(tree))


def test_quantized_slow_axis_matches_numpy_model(mesh2d):
    numel, block = 1000, 64
    comp = jc.Quantize(bits=8, block_size=block, error_feedback=True)
    like = {"g": jax.ShapeDtypeStruct((numel,), jnp.float32)}
    state = global_state(init_hierarchical_state(comp, like, inner_size=L, outer_size=S))

    def fn(t, s):
        return hierarchical_pmean(t, s, inner_axis="local", outer_axis="node", compressor=comp)

    c = -(-numel // L)  # each local rank's shard of the fast-axis mean
    models = [qref.QuantizeAllReduceModel(S, c, 8, block, True) for _ in range(L)]
    for step in range(3):
        tree = stacked(10 + step, {"g": (numel,)})
        out, state = run(mesh2d, fn, tree, state)
        x = tree["g"].reshape(S, L, numel)
        node_mean = np.pad(x.mean(1, dtype=np.float32), ((0, 0), (0, L * c - numel)))
        shards = node_mean.reshape(S, L, c)
        expected = np.concatenate([models[lr].step(shards[:, lr]) for lr in range(L)])[:numel]
        np.testing.assert_allclose(out["g"], expected, rtol=1e-5, atol=1e-6)


def test_only_the_compressed_shard_crosses_the_slow_axis(mesh2d):
    numel = 2**16
    comp = jc.Quantize(bits=8)
    like = {"g": jax.ShapeDtypeStruct((numel,), jnp.float32)}
    state = init_hierarchical_state(comp, like, inner_size=L, outer_size=S)

    def hier(t, s):
        return hierarchical_pmean(t, s, inner_axis="local", outer_axis="node", compressor=comp)

    def flat(t, s):
        return jax.tree.map(lambda x: lax.pmean(x, BOTH), t), s

    def text(fn, st):
        mapped = jax.shard_map(
            lambda t, s: fn(jax.tree.map(lambda x: x[0], t), s),
            mesh=mesh2d,
            in_specs=(P(BOTH), P(BOTH)),
            out_specs=(P(), P(BOTH)),
        )
        t = {"g": jax.ShapeDtypeStruct((S * L, numel), jnp.float32)}
        gs = jax.tree.map(lambda a: jax.ShapeDtypeStruct((S * L, *a.shape), a.dtype), st)
        return jax.jit(mapped).lower(t, gs).compile().as_text()

    by_axes = wire_bytes_by_axes(text(hier, state), mesh2d)
    assert set(by_axes) == {("node",), ("local",)}, by_axes
    shard = numel // L
    # Slow axis: int8 codes of one shard + one fp32 scale per 2048-block, both stages.
    slow = 2 * (S - 1) / S * (shard + 4 * (shard // 2048))
    assert by_axes[("node",)] == pytest.approx(slow)
    # Fast axis: exact fp32 reduce-scatter + all-gather.
    assert by_axes[("local",)] == pytest.approx(2 * (L - 1) / L * 4 * numel)
    flat_bytes = sum(wire_bytes_by_axes(text(flat, ()), mesh2d).values())
    assert flat_bytes / by_axes[("node",)] >= 25


def test_replica_group_forms():
    assert replica_groups("x, replica_groups=[4,2]<=[2,4]T(1,0), y", 8) == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert replica_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups={{0,2},{1,3}}, dims", 4) == [[0, 2], [1, 3]]
    assert replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
