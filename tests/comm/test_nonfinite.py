"""NaN/Inf gradients reach the output but never the error feedback (jaxcomm.comm.reduce guard).

Every compressor: a step with a NaN on one device, then one with an Inf on another, produce a
non-finite output (so loss scaling sees it), leave the state exactly as it was after the last
finite step, and count themselves in ``state.nonfinite``; the next finite step then gives
bit for bit what it gives straight after the last finite step (nothing was poisoned).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES
SHAPES = {"w": (6, 7), "b": (5,)}  # w is low-rank compressed by PowerSGD

COMPRESSORS = [
    pytest.param(jc.OneBit(), id="onebit"),
    pytest.param(jc.Quantize(bits=8, error_feedback=True), id="int8-ef"),
    pytest.param(jc.Quantize(bits=4, block_size=8, error_feedback=True), id="int4-ef"),
    pytest.param(jc.Cast(jnp.float16, error_feedback=True), id="fp16-ef"),
    pytest.param(jc.PowerSGD(rank=1), id="powersgd"),
    pytest.param(jc.TopK(fraction=0.25), id="topk"),
]


def data(seed, bad=None):
    rng = np.random.default_rng(seed)
    tree = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    if bad is not None:
        device, value = bad
        tree["w"][device, 2, 3] = value
    return tree


def make_step(mesh, comp, op):
    local = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    if op == "all_reduce":
        body = lambda t, s: jc.compressed_pmean(  # noqa: E731
            jax.tree.map(lambda x: x[0], t), s, axis_name="dp", compressor=comp
        )
        out_spec = P()
    else:
        body = lambda t, s: jc.compressed_pmean_scatter(  # noqa: E731
            jax.tree.map(lambda x: x[0], t), s, axis_name="dp", compressor=comp
        )
        out_spec = P("dp")
    state = jc.init_state(comp, local, axis_size=N, op=op)
    gstate = jc.stack_per_device(state, N)
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(out_spec, P("dp")))
    )
    return fn, gstate


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def bad_devices(scattered):
    """Per device: 1 if its rows of a reduce-scatter output are not all finite."""
    rows = [np.asarray(x).reshape(N, -1) for x in jax.tree.leaves(scattered)]
    return np.any([~np.isfinite(r).all(axis=1) for r in rows], axis=0).astype(int)


def finite(tree):
    return all(np.isfinite(x).all() for x in host(tree))


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("comp", COMPRESSORS)
def test_nonfinite_step_keeps_the_state_and_is_counted(mesh, comp, op):
    step, s0 = make_step(mesh, comp, op)
    assert np.asarray(s0.nonfinite).shape == (N, 1) and not np.asarray(s0.nonfinite).any()
    out1, s1 = step(data(1), s0)
    _, s1b = step(data(2), s1)
    assert finite(out1) and finite(s1)
    assert any(  # the finite step really moves the error feedback (else "kept" is vacuous)
        not np.array_equal(a, b) for a, b in zip(host(s1.buckets), host(s1b.buckets), strict=True)
    )

    out_nan, s2 = step(data(2, bad=(3, np.nan)), s1)
    out_inf, s3 = step(data(3, bad=(5, np.inf)), s2)
    for out in (out_nan, out_inf):
        assert not finite(out), "a non-finite gradient must reach the output"
    counts = np.asarray(s3.nonfinite).reshape(-1)
    if op == "all_reduce":
        # The output is replicated, so every device sees it and keeps its state.
        np.testing.assert_array_equal(counts, np.full(N, 2))
        for got, want in zip(host(s3.buckets), host(s1.buckets), strict=True):
            np.testing.assert_array_equal(got, want)
    else:
        # Scatter outputs are per device: a device keeps its state (and counts the step) when
        # its own row or its own new state is non-finite.
        bad_rows = sum(bad_devices(out) for out in (out_nan, out_inf))
        assert (counts >= bad_rows).all() and counts.max() <= 2 and bad_rows.max() >= 1
        for got, want in zip(host(s3.buckets), host(s1.buckets), strict=True):
            rows_got, rows_want = got.reshape(N, -1), want.reshape(N, -1)
            for r in np.flatnonzero(counts == 2):
                np.testing.assert_array_equal(rows_got[r], rows_want[r])
    assert finite(s3.buckets), "the error feedback was poisoned"

    # Nothing was lost: the next finite step equals the same step taken right after s1.
    out4, s4 = step(data(4), s3)
    if op == "all_reduce":
        ref_out, ref_s = step(data(4), s1)
        for got, want in zip(host((out4, s4.buckets)), host((ref_out, ref_s.buckets)), strict=True):
            np.testing.assert_array_equal(got, want)
    assert finite(out4) and finite(s4)
    np.testing.assert_array_equal(np.asarray(s4.nonfinite).reshape(-1), counts)


@pytest.mark.parametrize(
    "comp", [jc.NoCompression(), jc.Quantize(bits=8), jc.Cast(jnp.bfloat16)], ids=str
)
def test_stateless_compressors_propagate_nonfinite(mesh, comp):
    step, s0 = make_step(mesh, comp, "all_reduce")
    assert not jax.tree.leaves(s0)  # nothing to protect: no counter either
    for bad in ((0, np.nan), (7, -np.inf)):
        out, s = step(data(0, bad=bad), s0)
        assert not np.isfinite(out["w"]).all() and np.isfinite(out["b"]).all()
        assert not jax.tree.leaves(s)


def test_overflow_to_inf_is_treated_as_nonfinite(mesh):
    """Finite but huge inputs whose 1-bit scale overflows: the state is kept, the step counted."""
    step, s0 = make_step(mesh, jc.OneBit(), "all_reduce")
    _, s1 = step(data(1), s0)
    huge = jax.tree.map(lambda x: x * np.float32(5e37), data(2))
    assert finite(huge)
    out, s2 = step(huge, s1)
    assert not finite(out)
    np.testing.assert_array_equal(np.asarray(s2.nonfinite).reshape(-1), np.ones(N))
    for got, want in zip(host(s2.buckets), host(s1.buckets), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_guard_copies_no_error_buffer_when_the_state_is_donated_and_returned_first(mesh):
    # The guard keeps the old worker residual on a non-finite step with a select in the pass
    # that writes the new one: with the state donated (first in and out, as the docstring of
    # compressed_pmean says), that pass writes over the old residual in place. A 64 MiB copy of
    # it here cost the guard 7-12% of a OneBit op (benchmarks/compressors_1gbit.py).
    numel = 8 * N * 64
    comp = jc.OneBit()
    state = jc.init_state(comp, jax.ShapeDtypeStruct((numel,), jnp.float32), axis_size=N)
    gstate = jc.stack_per_device(state, N)

    def body(s, x):
        mean, s = jc.compressed_pmean(x, s, axis_name="dp", compressor=comp)
        return s, mean

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P("dp"), P())),
        donate_argnums=(0, 1),
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N * numel,)), jnp.float32)
    hlo = fn.lower(gstate, x).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    copies = [line.strip() for line in entry.splitlines() if " copy(" in line and "f32[" in line]
    assert not [c for c in copies if str(numel) in c], copies
    # and the step still keeps the residual on a non-finite input (the select is there)
    bad = x.at[3].set(jnp.nan)
    new_state, mean = fn(jax.tree.map(jnp.copy, gstate), bad)
    assert not np.isfinite(np.asarray(mean)).all()
    np.testing.assert_array_equal(
        np.asarray(new_state.buckets[0].worker_error), np.asarray(gstate.buckets[0].worker_error)
    )


# -- compressed_pmean_or_fallback: the mean, or the fallback's leaves where it is not finite --

# Aligned leaves (offsets and sizes multiples of 8: OneBit decodes them in rows of 8) and
# unaligned ones (cut from the flat mean).
FALLBACK_SHAPES = {
    "aligned": {"w": (8, 4), "v": (16,)},
    "unaligned": {"w": (6, 7), "b": (5,), "c": (3, 3)},
}


def make_fallback_steps(mesh, comp, shapes, bucket_bytes=None):
    """The same jitted shard_map of ``compressed_pmean`` and of ``compressed_pmean_or_fallback``
    (fallback: a replicated tree)."""
    local = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    state = jc.init_state(comp, local, axis_size=N, bucket_bytes=bucket_bytes)
    gstate = jc.stack_per_device(state, N)
    kw = dict(axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes)

    def plain(t, s):
        return jc.compressed_pmean(jax.tree.map(lambda x: x[0], t), s, **kw)

    def with_fallback(t, s, keep):
        return jc.compressed_pmean_or_fallback(jax.tree.map(lambda x: x[0], t), s, keep, **kw)

    specs = (P("dp"), P("dp"))
    plain = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=specs, out_specs=(P(), P("dp"))))
    with_fallback = jax.jit(
        jax.shard_map(
            with_fallback, mesh=mesh, in_specs=(*specs, P()), out_specs=(P(), P("dp"), P())
        )
    )
    return plain, with_fallback, gstate


def assert_same_mean(got, want, comp):
    """Bit for bit; PowerSGD's within the rounding of its matmuls: its mean is ``P Q^T`` of
    sums of up to ``k`` = 16 products (the longest side of FALLBACK_SHAPES), summed in an order
    XLA:CPU picks per fusion, and the fusion depends on what consumes the mean (here the
    finiteness test)."""
    if not isinstance(comp, jc.PowerSGD):
        np.testing.assert_array_equal(got, want)
        return
    k, eps = 16, np.finfo(np.float32).eps
    bound = k * eps * max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)


def tree_data(shapes, seed, bad=None):
    rng = np.random.default_rng(seed)
    tree = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in shapes.items()}
    if bad is not None:
        leaf, device, value = bad
        tree[leaf][device].reshape(-1)[-1] = value
    return tree


@pytest.mark.parametrize("layout", sorted(FALLBACK_SHAPES))
@pytest.mark.parametrize("comp", [*COMPRESSORS, pytest.param(jc.NoCompression(), id="exact")])
def test_pmean_or_fallback_is_the_mean_or_the_fallback(mesh, comp, layout):
    shapes = FALLBACK_SHAPES[layout]
    plain, with_fallback, s0 = make_fallback_steps(mesh, comp, shapes)
    keep = {k: np.full(s, 7.0, np.float32) for k, s in shapes.items()}
    _, s1 = plain(tree_data(shapes, 1), s0)
    # Finite: the mean and the state of compressed_pmean, bit for bit.
    want, want_state = plain(tree_data(shapes, 2), s1)
    got, got_state, finite_ = with_fallback(tree_data(shapes, 2), s1, keep)
    assert bool(finite_)
    for a, b in zip(host((got, got_state)), host((want, want_state)), strict=True):
        assert_same_mean(a, b, comp)
    # Not finite on one device: every leaf is the fallback's, the state is the guard's.
    bad = tree_data(shapes, 2, bad=(sorted(shapes)[-1], 3, np.nan))
    got, got_state, finite_ = with_fallback(bad, s1, keep)
    _, want_state = plain(bad, s1)
    assert not bool(finite_)
    for k in shapes:
        np.testing.assert_array_equal(np.asarray(got[k]), keep[k], err_msg=k)
    for a, b in zip(host(got_state), host(want_state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pmean_or_fallback_decides_each_bucket_alone(mesh):
    # One bucket per leaf: a NaN in "v" replaces "v" only, and finite says the call was not.
    shapes = FALLBACK_SHAPES["aligned"]
    plain, with_fallback, s0 = make_fallback_steps(mesh, jc.OneBit(), shapes, bucket_bytes=1)
    keep = {k: np.full(s, 7.0, np.float32) for k, s in shapes.items()}
    bad = tree_data(shapes, 3, bad=("v", 5, np.inf))
    want, _ = plain(bad, s0)
    got, _, finite_ = with_fallback(bad, s0, keep)
    assert not bool(finite_)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    assert np.isfinite(np.asarray(want["w"])).all()
    np.testing.assert_array_equal(np.asarray(got["v"]), keep["v"])


@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["one-bucket", "bucket-per-leaf"])
@pytest.mark.parametrize("comp", [jc.OneBit(), jc.Quantize(bits=8, error_feedback=True),
                                  jc.NoCompression()], ids=["onebit", "int8-ef", "exact"])
def test_pmean_or_fallback_returns_the_fresh_mean_before_its_fallback(mesh, comp, bucket_bytes):
    """``return_fresh``: the mean as computed, bit for bit ``compressed_pmean``'s where it is
    finite, and not the fallback where it is not (the caller reads it only where finite)."""
    shapes = FALLBACK_SHAPES["unaligned"]
    plain, _, s0 = make_fallback_steps(mesh, comp, shapes, bucket_bytes)
    kw = dict(axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes, return_fresh=True)

    def fresh_call(t, s, keep):
        local = jax.tree.map(lambda x: x[0], t)
        return jc.compressed_pmean_or_fallback(local, s, keep, **kw)

    fresh_call = jax.jit(
        jax.shard_map(
            fresh_call, mesh=mesh, in_specs=(P("dp"), P("dp"), P()),
            out_specs=(P(), P("dp"), P(), P()),
        )
    )  # fmt: skip
    keep = {k: np.full(s, 7.0, np.float32) for k, s in shapes.items()}
    for data, finite_expected in ((tree_data(shapes, 4), True),
                                  (tree_data(shapes, 4, bad=("w", 2, np.nan)), False)):  # fmt: skip
        want, _ = plain(data, s0)
        got, _, finite_, fresh = fresh_call(data, s0, keep)
        assert bool(finite_) is finite_expected
        if finite_expected:
            for k in shapes:
                np.testing.assert_array_equal(np.asarray(fresh[k]), np.asarray(want[k]))
                np.testing.assert_array_equal(np.asarray(fresh[k]), np.asarray(got[k]))
            continue
        bad_bucket = ["w"] if bucket_bytes else list(shapes)  # the leaves that fell back
        for k in bad_bucket:
            np.testing.assert_array_equal(np.asarray(got[k]), keep[k])
        assert not all(np.isfinite(np.asarray(fresh[k])).all() for k in bad_bucket)


def test_pmean_or_fallback_refuses_a_fallback_unlike_the_tree():
    tree = {"w": jnp.ones((4, 3))}
    call = lambda keep: jax.vmap(  # noqa: E731
        lambda x: jc.compressed_pmean_or_fallback(
            x, None, keep, axis_name="i", compressor=jc.NoCompression()
        ),
        axis_name="i",
    )(tree)
    with pytest.raises(ValueError, match="structure"):
        call({"v": jnp.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        call({"w": jnp.ones(4)})


VERDICT_FIRST = [
    pytest.param(jc.OneBit(), id="onebit"),
    pytest.param(jc.Quantize(bits=8, error_feedback=True), id="int8-ef"),
    pytest.param(jc.Quantize(bits=4, block_size=8, error_feedback=True), id="int4-ef"),
]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("comp", VERDICT_FIRST)
def test_the_verdict_exchanged_first_gives_the_same_steps(mesh, comp, op, monkeypatch):
    """The GPU form (the inputs' verdict exchanged before the payload, the residual written or
    kept in the encoding pass) against the CPU form (decided from the payloads received), run
    on CPU: finite steps, a NaN, an Inf, and inputs whose scale overflows give the same outputs,
    residuals and counts; the guarded programs hold one int32 all-reduce, before the payload
    (Quantize's reduce-scatter, the sharded optimizers', still decides after its payload)."""
    import jaxcomm.fusion as fusion
    from jaxcomm.inspect import collectives_in_hlo

    huge = jax.tree.map(lambda x: x * np.float32(5e37), data(6))
    inputs = [data(1), data(2, bad=(3, np.nan)), data(3), data(4, bad=(5, np.inf)), huge, data(5)]

    def run():
        step, state = make_step(mesh, comp, op)
        outs = []
        for x in inputs:
            out, state = step(x, state)
            outs.append((out, state))
        return step, state, outs

    _, _, want = run()
    monkeypatch.setattr(fusion, "_on_gpu_else", lambda *ops, gpu, other: gpu(*ops))
    step, state, got = run()
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(host(g), host(w), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"step {t}")
    text = step.lower(data(1), state).compile().as_text()
    ops = collectives_in_hlo(text)
    verdicts = [i for i, o in enumerate(ops) if o.op == "all-reduce"]
    if op == "reduce_scatter" and isinstance(comp, jc.Quantize):
        assert not verdicts, [o.line for o in ops]  # decided after the payload
        return
    assert [ops[i].dtypes for i in verdicts] == [("s32",)], [o.line for o in ops]
    assert verdicts[0] < min(i for i, o in enumerate(ops) if o.op == "all-to-all")
