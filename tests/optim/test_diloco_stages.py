"""The background sync's finish stage decides a Quantize mean's finiteness from its scales.

The reference is the decoded mean itself: the stage's flag must equal "some element of the
mean's first ``numel`` values is not finite" for every block content the codec can meet
(Inf, NaN, magnitudes whose ``2 absmax`` overflows, tiny and zero blocks) and for every cut
``numel`` (blocks wholly in the padding are not checked).
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm as jc
from jaxcomm.optim import diloco_stages as stages

SPECIALS = (np.inf, -np.inf, np.nan, 3.0e38, -2.0e38, 1.0e-45, 0.0)


def _gathered(compressor, chunks):
    """The all-gathered server wire of ``chunks`` ((n, B, L) fp32, one row per device)."""
    wire, _ = compressor._encode(jnp.asarray(chunks), 1)
    return tuple(wire)


@pytest.mark.parametrize("bits", [4, 8])
def test_mean_flag_equals_decoded_mean(bits):
    compressor = jc.Quantize(bits, block_size=8, error_feedback=True)
    n, numel = 2, 37
    leaves = [jnp.zeros((numel,), jnp.float32)]
    plan = stages.plan(compressor, leaves, None, n)
    (blocks, length) = plan.layouts[0]
    rng = np.random.default_rng(0)
    zeros = jnp.zeros((n * blocks * length,), jnp.float32)
    kept = ([jnp.zeros((blocks * length,), jnp.float32)], jnp.zeros([], jnp.int32))
    seen = {True: 0, False: 0}
    for trial in range(60):
        chunks = rng.standard_normal((n, blocks, length)).astype(np.float32)
        if trial % 6 == 5:  # a whole block of zeros
            chunks[rng.integers(n), rng.integers(blocks)] = 0.0
        for _ in range(trial % 3):
            r, b, i = rng.integers(n), rng.integers(blocks), rng.integers(length)
            chunks[r, b, i] = SPECIALS[rng.integers(len(SPECIALS))]
        gathered = [_gathered(compressor, chunks)]
        mean, (bad, count) = stages.finish(
            compressor, plan, gathered, [zeros], [kept[0][0]], kept, n
        )
        decoded = np.asarray(compressor._decode(gathered[0])).reshape(-1)[:numel]
        expected_bad = not np.all(np.isfinite(decoded))
        assert bool(bad) == expected_bad, (trial, chunks)
        assert int(count) == int(expected_bad)
        np.testing.assert_array_equal(np.asarray(mean[0]), decoded)
        seen[expected_bad] += 1
    assert seen[True] > 5 and seen[False] > 5  # both outcomes exercised


@pytest.mark.parametrize("bits", [4, 8])
def test_non_finite_only_in_padding_is_not_a_bad_mean(bits):
    compressor = jc.Quantize(bits, block_size=4, error_feedback=True)
    n, numel = 2, 9  # chunks of 2 blocks of 3 (int8) or 4 (int4): the last block is padding
    leaves = [jnp.zeros((numel,), jnp.float32)]
    plan = stages.plan(compressor, leaves, None, n)
    blocks, length = plan.layouts[0]
    chunks = np.ones((n, blocks, length), np.float32)
    chunks[-1, -1, -1] = np.inf
    last = (n * blocks - 1) * length
    assert last >= numel  # the whole last block lies in the padding
    zeros = jnp.zeros((n * blocks * length,), jnp.float32)
    kept = ([jnp.zeros((blocks * length,), jnp.float32)], jnp.zeros([], jnp.int32))
    _, (bad, _) = stages.finish(
        compressor, plan, [_gathered(compressor, chunks)], [zeros], [kept[0][0]], kept, n
    )
    assert not bool(bad)
