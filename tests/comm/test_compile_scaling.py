"""Compiled size linear in the number of buckets (issue 12): every bucket is its own chain.

A non-finite guard with one flag for all buckets made each bucket's state depend on every
other bucket's output, and XLA copied the shared check into each bucket's fusions: the compiled
program grew with the square of the bucket count (113 buckets of a 300-leaf tree did not
compile in 24 GB). The compiled instruction count per bucket must stay flat from 8 to 32.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES

LEAF = 256  # fp32 elements per leaf: 1 KiB, one leaf per bucket at bucket_bytes=1024


def compiled_instructions(mesh, comp, num_buckets: int) -> int:
    local = {f"w{i:03d}": jax.ShapeDtypeStruct((LEAF,), jnp.float32) for i in range(num_buckets)}
    state = jc.init_state(comp, local, axis_size=NUM_DEVICES, bucket_bytes=LEAF * 4)
    assert len(state.buckets) == num_buckets

    def body(tree, s):
        return jc.compressed_pmean(tree, s, axis_name="dp", compressor=comp, bucket_bytes=LEAF * 4)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )
    glob = lambda x: jax.ShapeDtypeStruct((NUM_DEVICES * x.shape[0], *x.shape[1:]), x.dtype)  # noqa: E731
    text = fn.lower(jax.tree.map(glob, local), jax.tree.map(glob, state)).compile().as_text()
    return sum(
        1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith("//")
    )


@pytest.mark.parametrize(
    "comp",
    [
        pytest.param(jc.OneBit(), id="onebit"),
        pytest.param(jc.Quantize(bits=8, error_feedback=True), id="int8-ef"),
        pytest.param(jc.TopK(fraction=0.25), id="topk"),
    ],
)
def test_instructions_per_bucket_flat_from_8_to_32_buckets(mesh, comp):
    per_bucket = {k: compiled_instructions(mesh, comp, k) / k for k in (8, 32)}
    assert per_bucket[32] <= 1.3 * per_bucket[8], per_bucket
