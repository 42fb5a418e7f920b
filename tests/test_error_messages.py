"""Errors a newcomer hits first: each says what is wrong and how to fix it, in one sentence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES


def pmean_step(mesh, compressor, bucket_bytes=None, state_spec=None):
    state_spec = P("dp") if state_spec is None else state_spec

    def body(g, s):
        return jc.compressed_pmean(
            g, s, axis_name="dp", compressor=compressor, bucket_bytes=bucket_bytes
        )

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), state_spec), out_specs=(P(), P("dp")))
    )


def test_stack_per_device_is_the_one_layout_for_shard_map_and_pmap(mesh):
    comp = jc.OneBit()
    tree = {"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones((8,))}
    state = jc.init_state(comp, tree, axis_size=N)
    glob = jc.stack_per_device(state, N)
    for got, local in zip(jax.tree.leaves(glob), jax.tree.leaves(state), strict=True):
        assert got.shape == (N, *local.shape)
        np.testing.assert_array_equal(got, np.broadcast_to(local, got.shape))
    # The stacked state goes through shard_map with P("dp") and comes back stacked; under pmap
    # the same stacked state is what every device's slot expects, and both give the same.
    grads = jax.tree.map(lambda x: jnp.concatenate([x + r for r in range(N)]), tree)
    out, new = pmean_step(mesh, comp)(grads, glob)
    assert np.asarray(new.nonfinite).sum() == 0
    pm = jax.pmap(
        lambda g, s: jc.compressed_pmean(g, s, axis_name="dp", compressor=comp), axis_name="dp"
    )
    stacked_grads = jax.tree.map(lambda x: x.reshape(N, -1, *x.shape[1:]), grads)
    out_p, new_p = pm(stacked_grads, glob)
    for a, b in zip(jax.tree.leaves(out_p), jax.tree.leaves(out), strict=True):
        np.testing.assert_allclose(np.asarray(a)[0], np.asarray(b), rtol=1e-6, atol=1e-6)
    for a, b, local in zip(
        jax.tree.leaves(new), jax.tree.leaves(new_p), jax.tree.leaves(state), strict=True
    ):
        assert a.shape == b.shape == (N, *local.shape)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bucket_count_mismatch_is_one_short_sentence(mesh):
    comp = jc.OneBit()
    tree = {f"l{i:03d}": jnp.ones((8, 8)) for i in range(113)}
    state = jc.stack_per_device(jc.init_state(comp, tree, axis_size=N), N)  # one bucket
    grads = jax.tree.map(lambda x: jnp.concatenate([x] * N), tree)
    with pytest.raises(ValueError) as e:
        pmean_step(mesh, comp, bucket_bytes=256)(grads, state)
    msg = str(e.value)
    assert "PyTreeDef" not in msg and len(msg) < 400, msg
    assert "state has 1 bucket, this call has 113 (bucket_bytes=256)" in msg
    assert "same bucket_bytes" in msg


def test_state_of_another_compressor_is_named(mesh):
    tree = {"w": jnp.ones((8, 8))}
    state = jc.stack_per_device(jc.init_state(jc.Quantize(bits=8), tree, axis_size=N), N)
    grads = jax.tree.map(lambda x: jnp.concatenate([x] * N), tree)
    with pytest.raises(ValueError) as e:
        pmean_step(mesh, jc.OneBit())(grads, state)
    msg = str(e.value)
    assert "PyTreeDef" not in msg and len(msg) < 400, msg
    assert "compressor" in msg


def test_state_passed_replicated_gets_a_layout_hint(mesh):
    comp = jc.OneBit()
    tree = {"w": jnp.ones((8, 8))}
    local = jc.init_state(comp, tree, axis_size=N)
    concat = jax.tree.map(lambda s: jnp.concatenate([s] * N), local)
    grads = jax.tree.map(lambda x: jnp.concatenate([x] * N), tree)
    with pytest.raises(ValueError) as e:
        pmean_step(mesh, comp, state_spec=P())(grads, concat)  # every device sees all 8 states
    assert "jc.stack_per_device" in str(e.value) and "P(" in str(e.value)


def test_non_array_leaves_are_named_by_path():
    with pytest.raises(TypeError) as e:
        jc.init_state(jc.OneBit(), {"enc": {"scale": 3, "w": jnp.ones(4)}}, axis_size=N)
    msg = str(e.value)
    assert "['enc']['scale']" in msg and "int" in msg and "leaf 0" not in msg
    with pytest.raises(TypeError) as e:
        jc.init_state(jc.OneBit(), {"z": jnp.ones(3, jnp.complex64)}, axis_size=N)
    assert "['z']" in str(e.value) and "complex" in str(e.value)
