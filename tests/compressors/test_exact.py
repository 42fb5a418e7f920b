"""The exact mean's bucket all-reduce: one collective over the concatenation on XLA:CPU, over
the leaves' pieces elsewhere (no copy of the bucket), the same sums either way."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.compressors.buckets import plan_buckets
from jaxcomm.compressors.exact import psum_pieces
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES


def tree_on(mesh, seed=0):
    rng = np.random.default_rng(seed)
    # Integer-valued fp32: every order of summation gives the same sums.
    tree = {
        "a": rng.integers(-50, 50, size=(N, 3, 4)).astype(np.float32),
        "b": rng.integers(-50, 50, size=(N, 7)).astype(np.float32),
        "c": rng.integers(-50, 50, size=(N, 1)).astype(np.float32),
    }
    return tree, jax.device_put(tree, NamedSharding(mesh, P("dp")))


def mean_program(mesh):
    def mean(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        return jc.compressed_pmean(tree, None, axis_name="dp", compressor=jc.NoCompression())[0]

    return jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P("dp"), out_specs=P()))


def test_the_exact_mean_of_a_bucket_of_leaves(mesh):
    tree, placed = tree_on(mesh)
    out = mean_program(mesh)(placed)
    for name, x in tree.items():
        np.testing.assert_array_equal(np.asarray(out[name]), x.mean(axis=0))


def test_psum_pieces_is_the_psum_of_the_concatenation(mesh):
    tree, placed = tree_on(mesh, seed=1)
    leaves = [x[0] for x in jax.tree.leaves(tree)]
    (bucket,) = plan_buckets(leaves, None, jc.NoCompression().compute_dtype)

    def both(*leaves):
        flat = jnp.concatenate([x[0].reshape(-1) for x in leaves])
        return psum_pieces(flat, bucket, "dp"), jax.lax.psum(flat, "dp")

    pieces, whole = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("dp"), out_specs=P()))(
        *jax.tree.leaves(placed)
    )
    np.testing.assert_array_equal(np.asarray(pieces), np.asarray(whole))


def test_off_the_cpu_each_leaf_is_reduced_where_it_lies(mesh):
    # Lowered for GPU (no GPU needed): one all_reduce per leaf (XLA's combiner makes them one
    # variadic all-reduce, and folds the concatenation around them away); on CPU one
    # all_reduce of the concatenated bucket.
    _, placed = tree_on(mesh)
    traced = mean_program(mesh).trace(placed)
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower().as_text()
    assert gpu.count("stablehlo.all_reduce") == 3
    assert cpu.count("stablehlo.all_reduce") == 1
