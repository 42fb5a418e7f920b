"""What crosses the wire, read from the compiled HLO of jaxcomm collectives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.inspect import collectives_in_hlo, wire_bytes
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES


def compiled_pmean(mesh, local_tree, compressor, bucket_bytes=None, exact=False):
    """Compiled HLO text of one pmean of a tree of per-device leaves (shapes of local_tree)."""
    state = jc.init_state(compressor, local_tree, axis_size=N, bucket_bytes=bucket_bytes)

    def body(t, s):
        t = jax.tree.map(lambda x: x[0], t)
        if exact:
            return jax.tree.map(lambda x: lax.pmean(x, "dp"), t), s
        return jc.compressed_pmean(
            t, s, axis_name="dp", compressor=compressor, bucket_bytes=bucket_bytes
        )

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((N, *x.shape), x.dtype), local_tree)
    global_state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((N * s.shape[0], *s.shape[1:]), s.dtype), state
    )
    return fn.lower(stacked, global_state).compile().as_text()


def tree_of_leaves(count: int, size: int = 37):
    return {f"l{i:03d}": jax.ShapeDtypeStruct((size + i % 5,), jnp.float32) for i in range(count)}


def test_300_leaf_tree_is_one_collective_round(mesh):
    tree = tree_of_leaves(300)
    no_comp = collectives_in_hlo(compiled_pmean(mesh, tree, jc.NoCompression()))
    onebit = collectives_in_hlo(compiled_pmean(mesh, tree, jc.OneBit()))
    per_leaf = collectives_in_hlo(compiled_pmean(mesh, tree, jc.NoCompression(), exact=True))
    assert 1 <= len(no_comp) <= 2, [o.op for o in no_comp]
    assert 1 <= len(onebit) <= 6, [o.op for o in onebit]
    assert {o.op for o in onebit} == {"all-to-all", "all-gather"}
    # The reference: XLA's own combiner may merge some of 300 pmeans, but it is not our fusion.
    assert len(per_leaf) >= len(no_comp)


def test_small_buckets_split_the_tree(mesh):
    tree = tree_of_leaves(300)
    leaf_bytes = 4 * 39  # about one leaf
    one = collectives_in_hlo(compiled_pmean(mesh, tree, jc.OneBit()))
    many = collectives_in_hlo(compiled_pmean(mesh, tree, jc.OneBit(), bucket_bytes=leaf_bytes * 60))
    buckets = len(jc.init_state(jc.OneBit(), tree, axis_size=N, bucket_bytes=leaf_bytes * 60)[0])
    assert buckets >= 5
    all_to_all = [o for o in many if o.op == "all-to-all"]
    assert len(all_to_all) == buckets
    assert len(many) > len(one)


@pytest.mark.parametrize("numel", [1 << 20, 3_000_017])
def test_onebit_moves_over_30x_fewer_bytes(mesh, numel):
    tree = {"g": jax.ShapeDtypeStruct((numel,), jnp.float32)}
    exact = wire_bytes(compiled_pmean(mesh, tree, jc.NoCompression()))
    onebit_ops = collectives_in_hlo(compiled_pmean(mesh, tree, jc.OneBit()))
    onebit = sum(o.wire_bytes for o in onebit_ops)
    np.testing.assert_allclose(exact, 2 * (N - 1) / N * 4 * numel, rtol=1e-6)
    assert exact / onebit >= 30, exact / onebit
    # No fp32 collective grows with N: only the n scales per stage travel as floats.
    for op in onebit_ops:
        if any(d.startswith("f") for d in op.dtypes):
            assert op.payload_bytes <= 4 * N, op.line
        else:
            assert op.dtypes == ("u8",), op.line


def test_bf16_leaves_travel_as_signs(mesh):
    tree = {"g": jax.ShapeDtypeStruct((1 << 18,), jnp.bfloat16)}
    ops = collectives_in_hlo(compiled_pmean(mesh, tree, jc.OneBit()))
    big = [o for o in ops if o.payload_bytes > 4 * N]
    assert big and all(o.dtypes == ("u8",) for o in big)


def _has_collective(eqn) -> bool:
    """An all_to_all or all_gather, directly or in every branch of a conditional (OneBit picks
    its collectives' layout per platform with ``lax.platform_dependent``, a conditional)."""
    if "all_to_all" in eqn.primitive.name or "all_gather" in eqn.primitive.name:
        return True
    branches = eqn.params.get("branches", ())
    return bool(branches) and all(any(_has_collective(e) for e in b.jaxpr.eqns) for b in branches)


def test_buckets_are_independent_chains(mesh):
    """No bucket's collective consumes another bucket's data: XLA may overlap them."""
    tree = {"a": jax.ShapeDtypeStruct((4096,), jnp.float32)} | {
        "b": jax.ShapeDtypeStruct((4096,), jnp.float32)
    }
    state = jc.init_state(jc.OneBit(), tree, axis_size=N, bucket_bytes=4 * 4096)

    def body(t, s):
        return jc.compressed_pmean(t, s, axis_name="dp", compressor=jc.OneBit(), bucket_bytes=16384)

    jaxpr = jax.make_jaxpr(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P("dp")))
    )(
        jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree),
        jax.tree.map(lambda s: jnp.zeros((N * s.shape[0],), s.dtype), state),
    )
    inner = jaxpr.jaxpr.eqns[0].params["jaxpr"]
    # Trace data dependence from bucket 0 (leaf a, its two error buffers) and bucket 1 (b, ...);
    # the state's last leaf is its non-finite counter.
    a, b, *errors, _ = inner.invars[-7:]  # leading invars are hoisted constants
    origin = {a: {0}, b: {1}, errors[0]: {0}, errors[1]: {0}, errors[2]: {1}, errors[3]: {1}}
    collectives = []
    for eqn in inner.eqns:
        ins = [origin.get(v, set()) for v in eqn.invars if not hasattr(v, "val")]
        if len(eqn.invars) == len(eqn.outvars) > 1:  # batched elementwise casts (pvary)
            outs = ins
        else:
            outs = [set().union(*ins)] * len(eqn.outvars)
        for var, deps in zip(eqn.outvars, outs, strict=True):
            origin[var] = deps
        if _has_collective(eqn):  # a collective, or one branch per platform around it
            collectives.append(set().union(*ins))
    assert len(collectives) == 4  # 2 per bucket (signs and scale in one, at each stage)
    assert sorted(tuple(sorted(d)) for d in collectives) == [(0,)] * 2 + [(1,)] * 2, collectives


# --------------------------------------------------------------------------------------------
# comms_report and compiled-HLO dependencies.
# --------------------------------------------------------------------------------------------


def _smap(mesh, body, in_specs, out_specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def test_comms_report_counts_and_bytes_match_the_hlo(mesh):
    from jaxcomm.inspect import compiled_text

    numel = 1 << 14
    comp = jc.OneBit()
    state = jc.init_state(comp, jax.ShapeDtypeStruct((numel,), jnp.float32), axis_size=N)
    gstate = jax.tree.map(lambda s: jax.ShapeDtypeStruct((N * s.shape[0],), s.dtype), state)
    x = jax.ShapeDtypeStruct((N * numel,), jnp.float32)

    def body(t, s):
        return jc.compressed_pmean(t, s, axis_name="dp", compressor=comp)

    fn = _smap(mesh, body, (P("dp"), P("dp")), (P(), P("dp")))
    report = jc.comms_report(fn, x, gstate, expect="uint8")
    ops = collectives_in_hlo(compiled_text(fn, x, gstate))
    assert report.ok, str(report)
    assert sum(r.count for r in report.rows) == len(ops) == 2
    np.testing.assert_allclose(report.wire_bytes, sum(o.wire_bytes for o in ops))
    rows = {(r.op, r.dtype): r for r in report.rows}
    # Per stage, one collective: numel/8 bytes of signs and each device's fp32 scale as 4 bytes
    # (the reference model's payload, in u8).
    assert set(rows) == {("all-to-all", "u8"), ("all-gather", "u8")}
    assert rows[("all-to-all", "u8")].payload_bytes == numel // 8 + 4 * N
    assert rows[("all-gather", "u8")].payload_bytes == numel // 8 + 4 * N
    assert report.num_devices == N and report.expect == "u8"


def test_comms_report_flags_an_fp32_payload_where_signs_are_expected(mesh):
    numel = 1 << 14
    fn = _smap(mesh, lambda t: lax.pmean(t, "dp"), P("dp"), P())
    report = jc.comms_report(fn, jax.ShapeDtypeStruct((N * numel,), jnp.float32), expect="uint8")
    (row,) = report.rows
    assert (row.op, row.dtype, row.count, row.payload_bytes) == ("all-reduce", "f32", 1, 4 * numel)
    assert not report.ok and "wider than the expected u8" in row.flag
    text = str(report)
    assert "!! wider than the expected u8" in text and "1 collective kind(s) flagged" in text
    # Without an expectation an exact fp32 pmean is what the program asked for: no flag.
    assert jc.comms_report(fn, jax.ShapeDtypeStruct((N * numel,), jnp.float32)).ok


def test_comms_report_flags_what_xla_widened(mesh):
    """A bf16 psum: flagged exactly when the compiled all-reduce is wider than bf16."""
    numel = 4096
    dtype_of = {"bf16": jnp.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64}

    def body(t):
        return lax.psum(t.astype(jnp.bfloat16), "dp").astype(jnp.float32)

    fn = _smap(mesh, body, P("dp"), P())
    arg = jax.ShapeDtypeStruct((N * numel,), jnp.float32)
    report = jc.comms_report(fn, arg)
    assert report.requested == {"all-reduce": frozenset({"bf16"})}
    (row,) = [r for r in report.rows if r.op == "all-reduce"]
    # What XLA compiled, read here with a regex rather than through jaxcomm's parser:
    # the flag must follow the compiled dtype, whichever way this compiler decided.
    compiled = re.findall(
        r"= (\w+)\[(\d+)\]\S* all-reduce(?:-start)?\(", fn.lower(arg).compile().as_text()
    )
    assert len(compiled) == 1, compiled
    dtype, elements = compiled[0]
    assert (row.dtype, row.payload_bytes) == (dtype, np.dtype(dtype_of[dtype]).itemsize * numel)
    assert int(elements) == numel
    if dtype == "bf16":
        assert row.flag == "", row
    else:
        assert row.flag.startswith("widened by XLA"), row


def test_report_from_hlo_rules():
    from jaxcomm.inspect import report_from_hlo

    def line(dtype, numel):
        return (
            f"  %ar = {dtype}[{numel}]{{0}} all-reduce(%p), channel_id=1, "
            "replica_groups={{0,1,2,3}}, to_apply=%add\n"
        )

    f32, bf16 = line("f32", 1024), line("bf16", 1024)
    asked = {"all-reduce": {"bf16"}}
    assert report_from_hlo(f32, asked).rows[0].flag.startswith("widened by XLA")
    assert report_from_hlo(bf16, asked).ok
    # expect: a large float payload wider than the compressed dtype is flagged, small ones not.
    assert not report_from_hlo(line("f32", 4096), expect="int8").ok
    assert report_from_hlo(f32, expect="int8").ok  # 4 KiB: at the small_bytes threshold
    assert report_from_hlo(line("f32", 8), expect="int8").ok
    assert report_from_hlo(line("s8", 4096), expect="int8").ok
    with pytest.raises(ValueError, match="unknown expected dtype"):
        report_from_hlo(f32, expect="not-a-dtype")


def test_compiled_buckets_are_independent_chains(mesh):
    """In the compiled program, each bucket's collectives read only that bucket's inputs."""
    from jaxcomm.inspect import collective_dependencies, compiled_text

    tree = {"a": jax.ShapeDtypeStruct((4096,), jnp.float32)} | {
        "b": jax.ShapeDtypeStruct((4096,), jnp.float32)
    }
    comp = jc.OneBit()
    state = jc.init_state(comp, tree, axis_size=N, bucket_bytes=4 * 4096)
    assert len(state.buckets) == 2

    def body(t, s):
        return jc.compressed_pmean(t, s, axis_name="dp", compressor=comp, bucket_bytes=16384)

    fn = _smap(mesh, body, (P(), P("dp")), (P(), P("dp")))
    gstate = jax.tree.map(lambda s: jax.ShapeDtypeStruct((N * s.shape[0],), s.dtype), state)
    deps = collective_dependencies(compiled_text(fn, tree, gstate))
    # Entry parameters are the flattened arguments: a, b, then the state's leaves in order.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    bucket_params = [
        {leaf} | {2 + j for j, p in enumerate(paths) if p.startswith(f".buckets[{leaf}]")}
        for leaf in (0, 1)
    ]
    assert all(len(ps) == 3 for ps in bucket_params)  # the leaf, worker and server error
    owners = []
    for op, params in deps:
        # A collective may read state shared by all buckets, never another bucket's data.
        owner = [i for i, ps in enumerate(bucket_params) if params & ps]
        assert len(owner) == 1, (op.line, sorted(params))
        owners.append(owner[0])
    assert len(deps) == 4 and sorted(owners) == [0] * 2 + [1] * 2  # one per stage and bucket


def test_async_start_with_context_scalars_counts_its_result_only():
    """TPU's ``all-to-all-start`` returns (operands, results, u32[] context, u32[] context):
    the payload is the result (512 B here), not the context scalars' 8 B; GPU's start tuple
    (operands, results) is counted as before."""
    from jaxcomm.inspect.hlo import collectives_in_hlo

    text = (
        "HloModule m, num_partitions=4\nENTRY %main {\n"
        "  %a = ((u32[128]{0}), (u32[128]{0}), u32[], u32[]) all-to-all-start(u32[128]{0} %p),"
        " replica_groups={{0,1,2,3}}\n"
        "  %g = (f32[8]{0}, f32[32]{0}) all-gather-start(f32[8]{0} %q),"
        " replica_groups={{0,1,2,3}}\n}\n"
    )
    a2a, gather = collectives_in_hlo(text)
    assert (a2a.op, a2a.payload_bytes, a2a.wire_bytes) == ("all-to-all", 512, 512 * 3 / 4)
    assert (gather.op, gather.payload_bytes, gather.wire_bytes) == ("all-gather", 128, 128 * 3 / 4)
