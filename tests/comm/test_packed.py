"""A compressed mean kept as it was sent (jaxcomm.comm.packed).

The packed mean a 1-bit all-reduce returns decodes, bit for bit, to the mean it returned, which
is the NumPy model's 1-bit mean (tests/reference/onebit_reference.py), bucket by bucket and leaf
by leaf; its template (``init_packed_mean``) has the structure, shapes and dtypes of what the
collective returns, so an optimizer state holding it keeps one type across steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.comm.packed import init_packed_mean, packed_mean_squares, packs_mean, unpack_mean
from jaxcomm.comm.reduce import reduce_tree
from tests.conftest import NUM_DEVICES
from tests.reference.onebit_reference import OneBitAllReduceModel

N = NUM_DEVICES
SHAPES = {"a": (5, 9), "b": (13,), "c": (3, 2, 2)}  # tree order a, b, c
SIZES = [45, 13, 12]


def per_device(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}


def flat(tree):
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(-1) for k in sorted(SHAPES)])


def build(mesh, compressor, bucket_bytes):
    """A jitted shard_map step: the mean with a fallback, its packed form, and the packed form
    decoded again."""
    local = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    state = jc.stack_per_device(
        jc.init_state(compressor, local, axis_size=N, bucket_bytes=bucket_bytes), N
    )

    def body(tree, comm, fallback):
        tree = jax.tree.map(lambda x: x[0], tree)
        reduced = reduce_tree(
            tree, comm, "dp", compressor, bucket_bytes, mean=True, op="all_reduce",
            fallback=fallback,
        )  # fmt: skip
        packed = jc.PackedMean(reduced.packed, jnp.bool_(True))
        decoded = unpack_mean(packed, tree, compressor, bucket_bytes)
        return reduced.tree, reduced.fresh, decoded, reduced.packed, reduced.state

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp"), P("dp"), P()),
            out_specs=(P(), P(), P(), P(), P("dp")),
            check_vma=False,
        )
    )
    return step, state, local


@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["one-bucket", "bucket-per-leaf"])
def test_packed_mean_decodes_to_the_onebit_mean(mesh, bucket_bytes):
    compressor = jc.OneBit()
    step, state, local = build(mesh, compressor, bucket_bytes)
    fallback = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    sizes = [sum(SIZES)] if bucket_bytes is None else SIZES
    models = [OneBitAllReduceModel(N, size) for size in sizes]
    template = init_packed_mean(local, compressor, bucket_bytes, "dp", N)
    for k in range(3):  # error feedback carried: later steps are not the first one again
        grads = per_device(k)
        mean, fresh, decoded, packed, state = step(grads, state, fallback)
        # Bit for bit: the packed form is what the mean was decoded from.
        for name in SHAPES:
            np.testing.assert_array_equal(np.asarray(decoded[name]), np.asarray(mean[name]))
            np.testing.assert_array_equal(np.asarray(fresh[name]), np.asarray(mean[name]))
        rows = flat_per_device(grads)
        expected, start = [], 0
        for model, size in zip(models, sizes, strict=True):
            expected.append(model.step(rows[:, start : start + size]))
            start += size
        np.testing.assert_allclose(
            flat(mean), np.concatenate(expected), rtol=2e-5, atol=2e-6, err_msg=f"step {k}"
        )
        # The state's template has the collective's structure, shapes and dtypes.
        got = jax.tree.map(lambda x: (x.shape, x.dtype), packed)
        want = jax.tree.map(lambda x: (x.shape, x.dtype), template.buckets)
        assert got == want
    assert not bool(template.valid)


@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["one-bucket", "bucket-per-leaf"])
def test_packed_mean_squares_are_the_decoded_leaves_mean_squares(mesh, bucket_bytes):
    """Each leaf's mean square, from the scales alone, is that of its decoded values, where
    leaves straddle the devices' chunks (8 devices: 16-element chunks of a 70-element bucket)
    and where each leaf has a bucket of its own; fp32 rounding of a few products."""
    compressor = jc.OneBit()
    step, state, local = build(mesh, compressor, bucket_bytes)
    fallback = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    for k in range(2):
        _, _, decoded, packed, state = step(per_device(10 + k), state, fallback)
        squares = packed_mean_squares(packed, local, compressor, bucket_bytes)
        for name in SHAPES:
            want = np.mean(np.square(np.asarray(decoded[name], np.float64)))
            np.testing.assert_allclose(float(squares[name]), want, rtol=2e-6, err_msg=name)


def test_packed_mean_squares_only_where_the_compressor_gives_them():
    """A compressor without them (the default) gives ``None``: the consumer reduces the
    decoded leaves itself."""
    local = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    packed = init_packed_mean(local, jc.OneBit(), None, "dp", N).buckets
    assert packed_mean_squares(packed, local, jc.Quantize(bits=8), None) is None
    zeros = packed_mean_squares(packed, local, jc.OneBit(), None)
    assert all(float(zeros[k]) == 0.0 for k in SHAPES)


def flat_per_device(tree):
    return np.concatenate(
        [np.asarray(tree[k], np.float64).reshape(N, -1) for k in sorted(SHAPES)], axis=1
    )


def test_packed_mean_is_onebits_only():
    """Compressors whose mean is not a packed message, tuples of axes and leafless or integer
    trees have none: the optimizer then always reads its dense copy."""
    local = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    assert packs_mean(local, jc.OneBit(), None, "dp")
    for compressor in (jc.NoCompression(), jc.Quantize(bits=8, error_feedback=True)):
        assert not packs_mean(local, compressor, None, "dp")
        assert init_packed_mean(local, compressor, None, "dp", N).buckets == ()
    assert not packs_mean(local, jc.OneBit(), None, ("node", "dp"))
    assert not packs_mean({}, jc.OneBit(), None, "dp")
    ints = {"n": jax.ShapeDtypeStruct((4,), jnp.int32)}
    assert not packs_mean(ints, jc.OneBit(), None, "dp")
