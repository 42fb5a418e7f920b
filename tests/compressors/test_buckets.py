"""jaxcomm.compressors.buckets: the bucket plan and both layouts, against NumPy models of them."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compressors import buckets as bk

RNG = np.random.default_rng(0)
SHAPES = [(3, 5), (7,), (), (2, 2, 2), (0, 4), (11,)]


def leaves_f32():
    return [RNG.normal(size=s).astype(np.float32) for s in SHAPES]


def one_bucket(leaves):
    (bucket,) = bk.plan_buckets(leaves, None, lambda d: np.dtype(np.float32))
    return bucket


def numpy_rank_major(leaves, n):
    """Rank-major layout from its definition: row r holds [r c_i, (r+1) c_i) of every leaf."""
    rows = []
    for r in range(n):
        row = []
        for x in leaves:
            flat = x.reshape(-1)
            c = math.ceil(flat.size / n)
            padded = np.zeros(n * c, np.float32)
            padded[: flat.size] = flat
            row.append(padded[r * c : (r + 1) * c])
        rows.append(np.concatenate(row))
    return np.stack(rows)


@pytest.mark.parametrize("a", [0, 1, 7, 8, 9, 100])
@pytest.mark.parametrize("b", [1, 3, 8])
def test_ceil_div_and_round_up(a, b):
    assert bk.ceil_div(a, b) == math.ceil(a / b)
    assert bk.round_up(a, b) == math.ceil(a / b) * b


def test_plan_groups_by_dtype_cuts_by_bytes_and_keeps_tree_order():
    leaves = [
        np.zeros((10,), np.float32),  # 40 B
        np.zeros((3,), np.int32),
        np.zeros((20,), np.float32),  # 80 B: 40 + 80 > 100, new bucket
        np.zeros((2,), np.bool_),
        np.zeros((5,), np.float32),  # 20 B: fits with the previous one
    ]
    buckets = bk.plan_buckets(leaves, 100, lambda d: np.dtype(np.float32))
    assert [b.leaf_ids for b in buckets] == [(0,), (1,), (2, 4), (3,)]
    assert [b.exact for b in buckets] == [False, True, False, True]
    assert buckets[2].numel == 25 and buckets[2].sizes == (20, 5)
    assert buckets[2].shard_sizes(3) == (7, 2) and buckets[2].shard_numel(3) == 9


def test_plan_refuses_bad_bucket_bytes_and_leaves():
    with pytest.raises(ValueError, match="bucket_bytes"):
        bk.plan_buckets([np.zeros(3)], 0, lambda d: d)
    with pytest.raises(TypeError, match="leaf 1"):
        bk.plan_buckets([np.zeros(3), 1.5], None, lambda d: d)
    with pytest.raises(TypeError, match="complex"):
        bk.plan_buckets([np.zeros(3, np.complex64)], None, lambda d: d)


def test_concatenated_layout_is_numpy_concatenate_and_round_trips():
    leaves = leaves_f32()
    bucket = one_bucket(leaves)
    flat = bk.flatten_bucket(leaves, bucket)
    np.testing.assert_array_equal(flat, np.concatenate([x.reshape(-1) for x in leaves]))
    for got, want in zip(bk.unflatten_bucket(flat, bucket), leaves, strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_rank_major_layout_matches_its_definition(n):
    leaves = leaves_f32()
    bucket = one_bucket(leaves)
    want = numpy_rank_major(leaves, n)
    rows = bk.flatten_bucket_rank_major(leaves, bucket, n)
    assert rows.shape == (n, bucket.shard_numel(n))
    np.testing.assert_array_equal(rows, want)
    # The same conversion from the concatenated layout, on device and on the host.
    flat = np.concatenate([x.reshape(-1) for x in leaves])
    np.testing.assert_array_equal(bk.concatenated_to_rank_major(jnp.asarray(flat), bucket, n), want)
    np.testing.assert_array_equal(bk.concatenated_to_rank_major(flat, bucket, n, xp=np), want)
    # Extra zero columns on request; the inverse ignores them.
    padded = bk.concatenated_to_rank_major(flat, bucket, n, bucket.shard_numel(n) + 5, xp=np)
    np.testing.assert_array_equal(padded[:, -5:], 0)
    np.testing.assert_array_equal(bk.rank_major_to_concatenated(padded, bucket, n, xp=np), flat)
    np.testing.assert_array_equal(bk.rank_major_to_concatenated(jnp.asarray(want), bucket, n), flat)
    for got, x in zip(bk.unflatten_rank_major(jnp.asarray(want), bucket, n), leaves, strict=True):
        np.testing.assert_array_equal(got, x)


def test_split_and_join_shards_are_inverse_and_check_shapes():
    leaves = leaves_f32()
    bucket = one_bucket(leaves)
    n = 3
    row = numpy_rank_major(leaves, n)[1]
    pieces = bk.split_shard(jnp.asarray(row), bucket, n)
    assert [p.shape for p in pieces] == [(c,) for c in bucket.shard_sizes(n)]
    np.testing.assert_array_equal(bk.join_shards(pieces, bucket, n), row)
    with pytest.raises(ValueError, match="shard 0"):
        bk.join_shards([jnp.zeros((99,)), *pieces[1:]], bucket, n)


def test_map_buckets_puts_leaves_back_in_tree_order():
    leaves = [
        np.full((2,), i, np.float32) if i % 2 else np.full((2,), i, np.int32) for i in range(5)
    ]
    buckets = bk.plan_buckets(leaves, None, lambda d: np.dtype(np.float32))
    out, extras = bk.map_buckets(
        lambda b, tag: ([leaves[i] * 10 for i in b.leaf_ids], (tag, b.leaf_ids)),
        buckets,
        len(leaves),
        ["first", "second"],
    )
    assert [int(x[0]) for x in out] == [0, 10, 20, 30, 40]
    assert extras == [("first", buckets[0].leaf_ids), ("second", buckets[1].leaf_ids)]
