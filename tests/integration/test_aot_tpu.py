"""A bucketed OneBit mean compiled for TPU v5e 2x2 with no TPU attached (libtpu's compiler).

Skipped unless libtpu is installed (``pip install "jax[tpu]"``, about 0.7 GB; the normal suite
does not need it). The bytes of the compiled collectives are checked against a count written
from the wire format (README, "OneBit, exactly"), not against jaxcomm's own bucket plan.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.inspect import collectives_in_hlo

N = 4  # devices of a v5e 2x2 slice
BUCKET_BYTES = 1024
# Every leaf is larger than a bucket, so each is a bucket of its own whatever the packing.
LEAF_SIZES = {"a": 300, "b": 500, "c": 1000}


def _unavailable(reason: str):
    """Skip, or fail where the run asked for the TPU compile (``make test-aot`` sets
    ``JAXCOMM_REQUIRE_TPU_COMPILE=1``, so that CI cannot pass by skipping)."""
    if os.environ.get("JAXCOMM_REQUIRE_TPU_COMPILE") == "1":
        pytest.fail(f"JAXCOMM_REQUIRE_TPU_COMPILE=1 but {reason}")
    pytest.skip(reason)


def _v5e_mesh():
    if importlib.util.find_spec("libtpu") is None:
        _unavailable('libtpu is not installed (pip install "jax[tpu]" to compile for TPU)')
    # libtpu takes a machine-wide lock file by default; compiling needs no exclusive TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc("v5e:2x2", "tpu")
    except Exception as e:  # noqa: BLE001 - any failure to load libtpu is a skip reason
        _unavailable(f"no TPU topology from libtpu: {type(e).__name__}: {e}")
    return topologies.make_mesh(topo, (N,), ("dp",))


def _signs_and_scale_bytes(numel: int, n: int) -> int:
    """Bytes one OneBit stage moves for a bucket of ``numel`` fp32 values on ``n`` devices:
    the bucket zero-padded to a multiple of ``8 n``, 8 signs per byte, one chunk of
    ``padded / (8 n)`` bytes per device with its fp32 scale (4 bytes) after it; on TPU each
    such row is zero-padded to whole 512-byte tiles (4 rows of 128 bytes, XLA:TPU's uint8
    layout), ``n`` rows per stage."""
    padded = math.ceil(numel / (8 * n)) * 8 * n
    row = padded // (8 * n) + 4
    return n * math.ceil(row / 512) * 512


def test_bucketed_onebit_mean_compiles_for_v5e_with_packed_sign_bytes():
    mesh = _v5e_mesh()
    comp = jc.OneBit()
    local = {k: jax.ShapeDtypeStruct((s,), jnp.float32) for k, s in LEAF_SIZES.items()}
    state = jc.stack_per_device(
        jc.init_state(comp, local, axis_size=N, bucket_bytes=BUCKET_BYTES), N
    )
    split = NamedSharding(mesh, P("dp"))

    def placed(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split)

    grads = {
        k: jax.ShapeDtypeStruct((N * s,), jnp.float32, sharding=split)
        for k, s in LEAF_SIZES.items()
    }
    state = jax.tree.map(placed, jax.eval_shape(lambda s: s, state))

    def body(g, s):
        return jc.compressed_pmean(g, s, axis_name="dp", compressor=comp, bucket_bytes=BUCKET_BYTES)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )
    compiled = fn.lower(grads, state).compile()
    text = compiled.as_text()
    ops = collectives_in_hlo(text)
    print("\n".join(f"{o.op} {o.dtypes} {o.payload_bytes} B" for o in ops))

    expected = sorted(_signs_and_scale_bytes(s, N) for s in LEAF_SIZES.values())
    # Worker stage: one uint8 all-to-all per bucket, the signs and the scale, nothing wider.
    a2a = sorted(o.payload_bytes for o in ops if o.op == "all-to-all")
    assert all(o.dtypes == ("u8",) for o in ops if o.op == "all-to-all")
    assert a2a == expected
    # Server stage: the same bytes gathered from every device, as uint8 all-gathers (rows of
    # whole tiles stay all-gathers; other rows became one zero-padded u32 all-reduce).
    gathered = sorted(o.payload_bytes for o in ops if o.op == "all-gather")
    assert all(o.dtypes == ("u8",) for o in ops if o.op == "all-gather")
    assert gathered == expected
    assert not [o for o in ops if o.op == "all-reduce" and "f32" not in o.dtypes]
    # Each device's row in whole (4, 128) tiles: laid out with no padding.
    for o in ops:
        if o.op == "all-gather":
            m = re.search(r"u8\[(\d+),(\d+),(\d+)\]\{2,1,0:T\(4,128\)", o.line)
            assert m and int(m.group(2)) == 4 and int(m.group(3)) % 128 == 0, o.line
    # No collective carries the gradients in fp32 (only flags and counters may be fp32).
    fp32 = sum(o.payload_bytes for o in ops if "f32" in o.dtypes)
    assert fp32 <= 4 * N, f"{fp32} B of fp32 collectives: the gradients crossed uncompressed"
    mem = compiled.memory_analysis()
    assert mem is not None and mem.argument_size_in_bytes > 0
