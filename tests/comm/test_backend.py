"""CommBackend: DeepSpeed's interface over jaxcomm collectives."""

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES
from tests.reference.onebit_reference import OneBitAllReduceModel

N = NUM_DEVICES


def shard_run(mesh, fn, stacked, out_spec=None):
    body = lambda t: fn(jax.tree.map(lambda x: x[0], t))  # noqa: E731
    out_spec = P() if out_spec is None else out_spec
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=out_spec))(stacked)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(N, 6, 5)).astype(np.float32),
        "k": rng.integers(-9, 9, size=(N, 3)).astype(np.int32),
    }


@pytest.mark.parametrize("op", list(jc.ReduceOp))
def test_exact_backend_ops_match_lax(mesh, op):
    backend = jc.CommBackend(jc.CommConfig(axis_name="dp", bucket_bytes=64))
    exact = {
        jc.ReduceOp.SUM: lax.psum,
        jc.ReduceOp.AVG: lax.pmean,
        jc.ReduceOp.MAX: lax.pmax,
        jc.ReduceOp.MIN: lax.pmin,
    }[op]

    def fn(t):
        out, _ = backend.all_reduce(t, None, op=op)
        return out, jax.tree.map(lambda x: exact(x, "dp"), t)

    out, ref = shard_run(mesh, fn, data())
    for key in ref:
        assert out[key].dtype == ref[key].dtype
        np.testing.assert_array_equal(out[key], ref[key])


def test_onebit_backend_avg_matches_model_and_refuses_max(mesh):
    backend = jc.CommBackend(jc.CommConfig(axis_name="dp", compressor=jc.OneBit(), axis_size=N))
    tree = {"g": np.random.default_rng(1).normal(size=(N, 100)).astype(np.float32)}
    state = backend.init_state({"g": tree["g"][0]})
    global_state = jc.stack_per_device(state, N)

    def body(t, s):
        return backend.all_reduce(jax.tree.map(lambda x: x[0], t), s, op=jc.ReduceOp.AVG)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    out, _ = jax.jit(fn)(tree, global_state)
    np.testing.assert_allclose(out["g"], OneBitAllReduceModel(N, 100).step(tree["g"]), rtol=2e-5)

    def bad(t):
        return backend.all_reduce(t, None, op=jc.ReduceOp.MAX)[0]

    with pytest.raises(ValueError, match="MAX cannot be compressed"):
        shard_run(mesh, bad, tree)


def test_reduce_scatter_coalesced_and_all_gather(mesh):
    backend = jc.CommBackend(jc.CommConfig(axis_name="dp"))
    stacked = {"a": np.random.default_rng(2).normal(size=(N, 19)).astype(np.float32)}
    like = {"a": jax.ShapeDtypeStruct((19,), np.float32)}

    def fn(t):
        shards, _ = backend.reduce_scatter_coalesced(t, None)
        full, _ = backend.all_gather(shards, like=like)
        return shards, full

    shards, full = shard_run(mesh, fn, stacked, out_spec=(P("dp"), P()))
    mean = stacked["a"].mean(0)
    padded = np.zeros(N * 3, np.float32)
    padded[:19] = mean
    np.testing.assert_allclose(shards["a"], padded, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full["a"], mean, rtol=1e-5, atol=1e-6)


def test_backend_rejects_a_non_config():
    with pytest.raises(TypeError, match="CommConfig"):
        jc.CommBackend({"axis_name": "dp"})
