"""Bad input gets a clear error at trace time, or documented behaviour: never a wrong answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES


def run(mesh, fn, tree, state):
    body = lambda t, s: fn(jax.tree.map(lambda x: x[0], t), s)  # noqa: E731
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    return jax.jit(mapped)(tree, state)


def stacked(*shape, seed=0):
    return {"g": np.random.default_rng(seed).normal(size=(N, *shape)).astype(np.float32)}


def global_state(state, n=N):
    return jc.stack_per_device(state, n)


def pmean(t, s, **kw):
    kw.setdefault("compressor", jc.OneBit())
    return jc.compressed_pmean(t, s, axis_name="dp", **kw)


def test_unbound_axis_is_named():
    tree = {"g": jnp.ones(8)}
    with pytest.raises(ValueError, match="axis name 'dp' is not bound"):
        jax.jit(lambda t: jc.compressed_pmean(t, None, axis_name="dp", compressor=jc.OneBit()))(
            tree
        )


def test_state_for_another_tree(mesh):
    state = jc.init_state(jc.OneBit(), {"g": jnp.zeros(1000)}, axis_size=N)
    with pytest.raises(ValueError, match="another tree"):
        run(mesh, pmean, stacked(10), global_state(state))


def test_state_for_another_axis_size(mesh):
    # Same tree, built for 4 devices: Np = 128 and Np/4 = 32 against 128 and 16 for 8.
    state = jc.init_state(jc.OneBit(), {"g": jnp.zeros(100)}, axis_size=4)
    with pytest.raises(ValueError, match="axis 'dp' of size 8"):
        run(mesh, pmean, stacked(100), global_state(state))


def test_state_for_another_bucket_size(mesh):
    tree = {"a": jnp.zeros(64), "b": jnp.zeros(64)}
    state = jc.init_state(jc.OneBit(), tree, axis_size=N, bucket_bytes=256)
    data = {k: np.ones((N, 64), np.float32) for k in tree}
    with pytest.raises(ValueError, match="bucket_bytes"):
        run(mesh, pmean, data, global_state(state))


def test_scatter_state_for_all_reduce(mesh):
    state = jc.init_state(jc.OneBit(), {"g": jnp.zeros(64)}, axis_size=N, op="reduce_scatter")
    with pytest.raises(ValueError, match="op='all_reduce'"):
        run(mesh, pmean, stacked(64), global_state(state))


def test_missing_state_for_a_stateful_compressor(mesh):
    state = jc.init_state(jc.OneBit(), {"g": jnp.zeros(64)}, axis_size=N)
    with pytest.raises(ValueError, match="this call needs a state"):
        run(mesh, lambda t, s: (pmean(t, None)[0], s), stacked(64), global_state(state))


@pytest.mark.parametrize("bucket_bytes", [0, -4, 1.5])
def test_bad_bucket_bytes(bucket_bytes):
    with pytest.raises(ValueError, match="bucket_bytes"):
        jc.init_state(jc.OneBit(), {"g": jnp.zeros(4)}, axis_size=2, bucket_bytes=bucket_bytes)


def test_bad_axis_size_and_op():
    with pytest.raises(ValueError, match="axis_size"):
        jc.init_state(jc.OneBit(), {"g": jnp.zeros(4)}, axis_size=0)
    with pytest.raises(ValueError, match="op must be"):
        jc.init_state(jc.OneBit(), {"g": jnp.zeros(4)}, axis_size=2, op="all_gather")


def test_not_a_compressor(mesh):
    with pytest.raises(TypeError, match="Compressor"):
        run(mesh, lambda t, s: (pmean(t, None, compressor="onebit")[0], s), stacked(8), ())


def test_complex_and_non_array_leaves():
    with pytest.raises(TypeError, match="complex"):
        jc.init_state(jc.OneBit(), {"c": jnp.zeros(4, jnp.complex64)}, axis_size=2)
    with pytest.raises(TypeError, match="expected an array"):
        jc.init_state(jc.OneBit(), {"f": 1.0}, axis_size=2)


def test_all_gather_shard_of_wrong_shape(mesh):
    like = {"g": jax.ShapeDtypeStruct((20,), jnp.float32)}  # c = ceil(20/8) = 3

    def fn(t, s):
        out, _ = jc.compressed_all_gather(
            {"g": t["g"][:2]}, None, axis_name="dp", compressor=jc.NoCompression(), like=like
        )
        return out, s

    with pytest.raises(ValueError, match=r"expected \(3,\)"):
        run(mesh, fn, stacked(5), ())


def test_non_finite_input_propagates_to_the_output(mesh):
    """Documented: a NaN/Inf gradient makes the compressed result NaN, so loss scaling sees it."""
    data = stacked(64)
    data["g"][3, 5] = np.nan
    state = jc.init_state(jc.OneBit(), {"g": jnp.zeros(64)}, axis_size=N)
    out, _ = run(mesh, pmean, data, global_state(state))
    assert np.isnan(out["g"]).any()
