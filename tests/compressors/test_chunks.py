"""The compact offset code of jaxcomm.compressors.chunks against the NumPy model
(tests/reference/offsets_reference.py): which code a chunk gets, the exact bytes, and the round
trip (the offsets every receiver decodes)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compressors.chunks import (
    ChunkPlan,
    decode_offsets,
    encode_offsets,
    index_bits,
    pack_bits,
    split_rows,
    stacked_plan,
    tile_groups,
    unpack_bits,
    unpack_grouped_offsets,
    wire_order,
)
from tests.reference.offsets_reference import offset_bits, offset_stream, value_order

# (h, w, k, bits per chunk): 64x64 tiles keeping 32, 64 or 128 (Elias-Fano: 288, 512, 896
# bits instead of 12 a value), a 12x40 tile keeping 16 (Elias-Fano, 4 low bits), a vector chunk
# keeping half (a 64-bit mask), one keeping 4 or 1 (6-bit fields), 35 keeping 16 (mask), a
# scalar (nothing).
CASES = [
    (64, 64, 32, 288),
    (64, 64, 64, 512),
    (64, 64, 128, 896),
    (12, 40, 16, 110),
    (1, 64, 32, 64),
    (1, 64, 4, 24),
    (1, 64, 1, 6),
    (1, 35, 16, 35),
    (1, 1, 1, 0),
]


@pytest.mark.parametrize("h, w, k, per_chunk", CASES)
def test_offsets_code_matches_the_numpy_model_and_round_trips(h, w, k, per_chunk):
    plan = ChunkPlan(rows=2 * h, cols=3 * w, h=h, w=w, k=k)
    rng = np.random.default_rng(h * w + k)
    idx = np.stack([rng.choice(h * w, k, replace=False) for _ in range(plan.chunks)])
    ordered = np.asarray(wire_order(jnp.asarray(idx, jnp.int32), plan))
    np.testing.assert_array_equal(ordered, value_order(idx, h * w))
    assert index_bits(plan) == per_chunk == offset_bits(h * w, k)
    bits = encode_offsets(jnp.asarray(ordered), plan)
    assert bits.shape == (per_chunk * plan.chunks,)
    packed = np.asarray(pack_bits(bits))
    np.testing.assert_array_equal(packed, offset_stream(ordered, h * w))
    # Two devices' messages side by side, decoded at once.
    both = jnp.stack([jnp.asarray(packed)] * 2)
    got = np.asarray(decode_offsets(unpack_bits(both, bits.shape[0]), plan))
    np.testing.assert_array_equal(got, np.stack([ordered] * 2))
    # The same kept elements, whichever order they travel in.
    np.testing.assert_array_equal(np.sort(got[0], axis=1), np.sort(idx, axis=1))


def test_grouped_decode_gives_each_tile_groups_offsets_stacked_in_leaf_order():
    # Leaves as DeMo sees them: two tile groups interleaved, a fields-coded one, an empty one.
    plans = [
        ChunkPlan(rows=128, cols=64, h=64, w=64, k=32),
        ChunkPlan(rows=1, cols=128, h=1, w=64, k=32),
        ChunkPlan(rows=0, cols=0, h=1, w=1, k=0),
        ChunkPlan(rows=64, cols=192, h=64, w=64, k=32),
        ChunkPlan(rows=1, cols=192, h=1, w=64, k=32),
        ChunkPlan(rows=1, cols=128, h=1, w=64, k=4),
    ]
    assert tile_groups(plans) == [[0, 3], [1, 4], [5]]
    assert tile_groups(plans, alone_from=3) == [[0], [1], [3], [4], [5]]
    rng = np.random.default_rng(7)
    idx = {}
    for i, plan in enumerate(plans):
        if plan.kept:
            raw = np.stack(
                [rng.choice(plan.length, plan.k, replace=False) for _ in range(plan.chunks)]
            )
            idx[i] = value_order(raw, plan.length)
    bits = jnp.concatenate([encode_offsets(jnp.asarray(idx[i], jnp.int32), plans[i]) for i in idx])
    packed = jnp.stack([pack_bits(bits)] * 2)  # two devices' messages
    for groups in (tile_groups(plans), tile_groups(plans, alone_from=3)):
        for members, got in zip(groups, unpack_grouped_offsets(packed, plans, groups), strict=True):
            want = np.concatenate([idx[i] for i in members])
            assert stacked_plan([plans[i] for i in members]).chunks == len(want)
            np.testing.assert_array_equal(np.asarray(got), np.stack([want] * 2))
            for i, rows in zip(members, split_rows(members, plans), strict=True):
                np.testing.assert_array_equal(np.asarray(got[0, rows]), idx[i])
