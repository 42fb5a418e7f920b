"""The compressor family (Quantize, Cast, TopK, PowerSGD) against NumPy models and HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.compressors import pack_int4, quantize_blocks, unpack_int4
from jaxcomm.inspect import collectives_in_hlo, wire_bytes
from tests.conftest import NUM_DEVICES
from tests.reference import quantize_reference as qref

N = NUM_DEVICES


def stacked(seed: int, shapes: dict, n: int = N, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=(n, *s))).astype(np.float32) for k, s in shapes.items()}


def local(tree):
    return jax.tree.map(lambda x: x[0], tree)


def global_state(state, n: int = N):
    return jc.stack_per_device(state, n)


def reduce_steps(mesh, trees, comp, *, mean=True, bucket_bytes=None):
    """Thread the state through ``len(trees)`` compressed p{mean,sum} calls; outputs, states."""
    n = mesh.shape["dp"]
    state = jc.init_state(comp, local(trees[0]), axis_size=n, bucket_bytes=bucket_bytes)
    collective = jc.compressed_pmean if mean else jc.compressed_psum

    def body(t, s):
        return collective(local(t), s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )
    gstate, outs, states = global_state(state, n), [], []
    states.append(gstate)
    for tree in trees:
        out, gstate = step(tree, gstate)
        outs.append(jax.tree.map(np.asarray, out))
        states.append(gstate)
    return outs, states


def compiled(mesh, local_tree, body, state=()):
    """Compiled HLO text of ``body(local_tree, state)`` in shard_map over 'dp'."""
    fn = jax.jit(
        jax.shard_map(
            lambda t, s: body(local(t), s),
            mesh=mesh,
            in_specs=(P("dp"), P("dp")),
            out_specs=(P(), P("dp")),
        )
    )
    stacked_tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct((N, *x.shape), x.dtype), local_tree)
    gs = jax.tree.map(lambda s: jax.ShapeDtypeStruct((N, *s.shape), s.dtype), state)
    return fn.lower(stacked_tree, gs).compile().as_text()


def pmean_hlo(mesh, local_tree, comp):
    state = jc.init_state(comp, local_tree, axis_size=N)
    return compiled(
        mesh,
        local_tree,
        lambda t, s: jc.compressed_pmean(t, s, axis_name="dp", compressor=comp),
        state,
    )


def exact_pmean_hlo(mesh, local_tree):
    return compiled(
        mesh, local_tree, lambda t, s: (jax.tree.map(lambda x: lax.pmean(x, "dp"), t), s)
    )


# --------------------------------------------------------------------------------------------
# Quantize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_blocks_matches_rules(bits):
    rng = np.random.default_rng(0)
    blocks = rng.normal(size=(6, 33)).astype(np.float32)
    blocks[1] = 0.0  # absmax 0: scale 1, codes 0
    # Exact ties: absmax 4 gives scale 2^b/8, so x = (k + 0.5) * 8/2^b lands on k + 0.5.
    blocks[2, :8] = (np.arange(8) - 3.5) * 8 / 2**bits
    blocks[2, 8] = 4.0  # absmax: x * scale = 2^(b-1), clamped to 2^(b-1) - 1
    blocks[2, 9:] = 0.0
    q, inv = quantize_blocks(jnp.asarray(blocks), bits)
    q_ref, inv_ref = qref.quantize(blocks, bits)
    np.testing.assert_array_equal(np.asarray(q), q_ref)
    np.testing.assert_array_equal(np.asarray(inv), inv_ref)
    assert np.asarray(q)[2, 8] == 2 ** (bits - 1) - 1
    assert np.all(np.asarray(q)[1] == 0) and np.asarray(inv)[1] == 1.0
    # Half to even: -3.5 -> -4, -2.5 -> -2, ..., 3.5 -> 4 (clamped only at 2^(b-1)).
    np.testing.assert_array_equal(np.asarray(q)[2, :8], [-4, -2, -2, 0, 0, 2, 2, 4])


def test_int4_pack_roundtrip_all_pairs():
    values = np.array([(a, b) for a in range(-8, 8) for b in range(-8, 8)], np.int8).reshape(-1)
    packed = pack_int4(jnp.asarray(values))
    assert packed.dtype == jnp.uint8 and packed.shape == (256,)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), values)
    # Element 2i in the low nibble: an independent bit-level check.
    np.testing.assert_array_equal(
        np.asarray(packed),
        (values[0::2].astype(np.uint8) & 15) | (values[1::2].astype(np.uint8) << 4),
    )


@pytest.mark.parametrize("error_feedback", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [13, 5000])
def test_quantize_all_reduce_matches_numpy_model(mesh, bits, error_feedback, numel):
    comp = jc.Quantize(bits=bits, block_size=256, error_feedback=error_feedback)
    trees = [stacked(100 + k, {"g": (numel,)}) for k in range(4)]
    outs, _ = reduce_steps(mesh, trees, comp)
    model = qref.QuantizeAllReduceModel(N, numel, bits, 256, error_feedback)
    for tree, out in zip(trees, outs, strict=True):
        np.testing.assert_allclose(out["g"], model.step(tree["g"]), rtol=1e-6, atol=1e-7)


def test_quantize_psum_multi_leaf_and_dtypes(mesh):
    comp = jc.Quantize(bits=8, block_size=64, error_feedback=True)
    trees = [stacked(200 + k, {"a": (3, 40), "b": (17,), "c": ()}) for k in range(3)]
    trees = [dict(t, h=t["b"].astype(jnp.bfloat16)) for t in trees]
    outs, _ = reduce_steps(mesh, trees, comp, mean=False)
    model = qref.QuantizeAllReduceModel(N, 120 + 17 + 1 + 17, 8, 64, True)
    for tree, out in zip(trees, outs, strict=True):
        flat = np.concatenate(
            [np.asarray(tree[k], np.float32).reshape(N, -1) for k in ("a", "b", "c", "h")], axis=1
        )
        expected = N * model.step(flat)
        got = np.concatenate([np.asarray(out[k], np.float32).reshape(-1) for k in "abc"])
        np.testing.assert_allclose(got, expected[:138], rtol=1e-5, atol=1e-6)
        assert out["h"].dtype == jnp.bfloat16 and out["a"].shape == (3, 40)
        np.testing.assert_allclose(np.asarray(out["h"], np.float32), expected[138:], rtol=1e-2)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_error_feedback_invariant_both_stages(mesh, bits):
    """Worker: buf == deq(q(buf)) + e_w; server: mean_j(buf_j - e_w_j) + e_s_old == out + e_s."""
    numel, block = 600, 128
    comp = jc.Quantize(bits=bits, block_size=block, error_feedback=True)
    trees = [stacked(300 + k, {"g": (numel,)}) for k in range(3)]
    outs, states = reduce_steps(mesh, trees, comp)
    nb, ln = qref.layout(-(-numel // N), block, bits)
    chunk = nb * ln
    for k, (tree, out) in enumerate(zip(trees, outs, strict=True)):
        (old,), (new,) = states[k].buckets, states[k + 1].buckets
        e_w_old = np.asarray(old.worker_error).reshape(N, N * chunk)
        e_w_new = np.asarray(new.worker_error).reshape(N, N * chunk)
        x = np.zeros((N, N * chunk), np.float32)
        x[:, :numel] = tree["g"]
        sent = x + e_w_old - e_w_new  # what each worker's codes decode to
        # Worker stage: with step 1/scale = 2 absmax(buf) / 2^b, `sent` is an integer number of
        # steps in [-2^(b-1), 2^(b-1) - 1] and the residual is at most half a step (one step
        # where the top code is clamped).
        buf = (x + e_w_old).reshape(N, N * nb, ln)
        step = 2 * np.abs(buf).max(-1, keepdims=True) / 2**bits
        step = np.where(step == 0, 1, step)
        levels = sent.reshape(buf.shape) / step
        np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)
        top = 2 ** (bits - 1)
        assert levels.min() >= -top - 1e-3 and levels.max() <= top - 1 + 1e-3
        resid = np.abs(e_w_new.reshape(buf.shape))
        assert np.all(resid <= step * (1 + 1e-4)), (resid / step).max()
        e_s_old = np.asarray(old.server_error).reshape(N, chunk)
        e_s_new = np.asarray(new.server_error).reshape(N, chunk)
        out_full = np.zeros(N * chunk, np.float32)
        out_full[:numel] = out["g"]
        lhs = (sent.mean(0).reshape(N, chunk) + e_s_old).reshape(-1)[:numel]
        rhs = (out_full.reshape(N, chunk) + e_s_new).reshape(-1)[:numel]
        np.testing.assert_allclose(lhs, rhs, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_reduce_scatter_and_all_gather_match_models(mesh, bits):
    comp = jc.Quantize(bits=bits, block_size=32)
    tree = stacked(400, {"a": (50,), "b": (7, 3)})
    like = local(tree)

    def body(t):
        t = local(t)
        shards, _ = jc.compressed_pmean_scatter(t, None, axis_name="dp", compressor=comp)
        full, _ = jc.compressed_all_gather(shards, None, axis_name="dp", compressor=comp, like=t)
        return shards, full

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=(P("dp"), P("dp"))))
    shards, full = fn(tree)
    sizes = {"a": 7, "b": 3}  # ceil(50/8), ceil(21/8)
    rows = np.concatenate(
        [
            np.pad(tree[k].reshape(N, -1), ((0, 0), (0, N * c - like[k].size))).reshape(N, N, c)
            for k, c in sizes.items()
        ],
        axis=2,
    )  # [device, rank, C]
    expected = qref.quantize_reduce_scatter_mean(rows, bits, 32)
    got = np.concatenate([np.asarray(shards[k]).reshape(N, -1) for k in sizes], axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # Gather of those shards (identical on every device): qwZ quantization of each row.
    gathered = qref.quantize_all_gather(expected, bits, 32)
    start = 0
    for k, c in sizes.items():
        want = gathered[:, start : start + c].reshape(-1)[: like[k].size].reshape(like[k].shape)
        start += c
        for d in range(N):
            np.testing.assert_allclose(
                np.asarray(full[k]).reshape(N, *like[k].shape)[d], want, rtol=1e-6, atol=1e-7
            )


def test_quantize_scatter_error_feedback_invariant(mesh):
    comp = jc.Quantize(bits=4, block_size=16, error_feedback=True)
    tree = stacked(410, {"a": (100,)})
    state = jc.init_state(comp, local(tree), axis_size=N, op="reduce_scatter")

    fn = jax.jit(
        jax.shard_map(
            lambda t, s: jc.compressed_pmean_scatter(local(t), s, axis_name="dp", compressor=comp),
            mesh=mesh,
            in_specs=(P("dp"), P("dp")),
            out_specs=(P("dp"), P("dp")),
        )
    )
    out, new = fn(tree, global_state(state))
    c = 13  # ceil(100/8), one block of 14 (int4: even)
    e = np.asarray(new.buckets[0].worker_error).reshape(N, N, 14)
    x = np.zeros((N, N, 14), np.float32)
    x[:, :, :c] = np.pad(tree["a"], ((0, 0), (0, 4))).reshape(N, N, c)
    # mean_j (x_j - e_j)[rank r] == out[r]: the reduction itself is exact fp32.
    got = np.asarray(out["a"]).reshape(N, c)
    np.testing.assert_allclose((x - e).mean(0)[:, :c], got, atol=1e-6)


def test_quantize_pmap_matches_shard_map(mesh):
    comp = jc.Quantize(bits=8, block_size=64, error_feedback=True)
    tree = stacked(500, {"g": (300,)})
    state = jc.init_state(comp, local(tree), axis_size=N)
    (sm_out,), _ = reduce_steps(mesh, [tree], comp)

    step = jax.pmap(
        lambda t, s: jc.compressed_pmean(t, s, axis_name="i", compressor=comp), axis_name="i"
    )
    out, _ = step(tree, jax.tree.map(lambda s: jnp.stack([s] * N), state))
    for d in range(N):
        np.testing.assert_allclose(np.asarray(out["g"][d]), sm_out["g"], rtol=1e-6, atol=1e-7)


def test_quantize_nonfinite_input_gives_nonfinite_output(mesh):
    tree = stacked(600, {"g": (64,)})
    tree["g"][3, 5] = np.nan
    tree["g"][1, 40] = np.inf
    (out,), _ = reduce_steps(mesh, [tree], jc.Quantize(bits=8, block_size=16))
    assert not np.isfinite(out["g"][5]) and not np.isfinite(out["g"][40])


@pytest.mark.parametrize(
    "kwargs", [{"bits": 2}, {"bits": 16}, {"block_size": 1}, {"block_size": 0}, {"block_size": 2.5}]
)
def test_quantize_rejects_bad_config(kwargs):
    with pytest.raises(ValueError, match="Quantize"):
        jc.Quantize(**kwargs)


@pytest.mark.parametrize("bits, floor", [(8, 3.9), (4, 7.5)])
def test_quantize_hlo_wire_ratio(mesh, bits, floor):
    tree = {"g": jax.ShapeDtypeStruct((2**18,), jnp.float32)}
    for ef in (False, True):
        text = pmean_hlo(mesh, tree, jc.Quantize(bits=bits, error_feedback=ef))
        ops = collectives_in_hlo(text)
        assert {o.op for o in ops} <= {"all-to-all", "all-gather"}, [o.line for o in ops]
        # Codes travel as 8-bit integers, never summed: only s8/u8 codes and f32 scales.
        assert {d for o in ops for d in o.dtypes} == {"s8" if bits == 8 else "u8", "f32"}
        ratio = wire_bytes(exact_pmean_hlo(mesh, tree)) / wire_bytes(text)
        assert ratio >= floor, ratio


# --------------------------------------------------------------------------------------------
# Cast
# --------------------------------------------------------------------------------------------


class CastModel:
    """NumPy model of the 16-bit cast all-reduce (mean), all devices at once.

    ``c_j = cast(x_j / n + e_w[j] / n)``; ``e_w[j] = x_j + e_w[j] - n c_j``; device ``r``:
    ``m_r = sum_j c_j[chunk r] + e_s[r]``; ``e_s[r] = m_r - cast(m_r)``; output ``cast(m)``.
    """

    def __init__(self, n, numel, dtype, error_feedback):
        self.n, self.numel, self.dtype, self.ef = n, numel, np.dtype(dtype), error_feedback
        self.chunk = -(-numel // n)
        self.worker_error = np.zeros((n, n * self.chunk), np.float32)
        self.server_error = np.zeros((n * self.chunk,), np.float32)

    def step(self, xs):
        n = self.n
        buf = np.zeros((n, n * self.chunk), np.float32)
        buf[:, : self.numel] = xs
        if self.ef:
            buf = buf + self.worker_error
        sent = (buf / np.float32(n)).astype(self.dtype).astype(np.float32)
        if self.ef:
            self.worker_error = buf - sent * np.float32(n)
        m = np.zeros(n * self.chunk, np.float32)
        for j in range(n):
            m = m + sent[j]
        if self.ef:
            m = m + self.server_error
        out = m.astype(self.dtype).astype(np.float32)
        if self.ef:
            self.server_error = m - out
        return out[: self.numel]


@pytest.mark.parametrize("error_feedback", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_cast_matches_numpy_model(mesh, dtype, error_feedback):
    comp = jc.Cast(dtype, error_feedback=error_feedback)
    numel = 1001
    trees = [stacked(700 + k, {"g": (numel,)}) for k in range(4)]
    outs, _ = reduce_steps(mesh, trees, comp)
    model = CastModel(N, numel, dtype, error_feedback)
    for tree, out in zip(trees, outs, strict=True):
        np.testing.assert_allclose(out["g"], model.step(tree["g"]), rtol=1e-6, atol=1e-7)


def test_cast_fp16_pre_divides_so_large_sums_do_not_overflow(mesh):
    comp = jc.Cast(jnp.float16)
    tree = {"g": np.full((N, 16), 60000.0, np.float32)}  # sum 480000 > fp16 max 65504
    tree["g"][:, 0] = 70000.0  # a mean beyond the fp16 range: documented to become inf
    (out,), _ = reduce_steps(mesh, [tree], comp, mean=False)
    np.testing.assert_allclose(out["g"][1:], 480000.0, rtol=1e-3)
    assert np.isposinf(out["g"][0])
    (out,), _ = reduce_steps(mesh, [tree], comp, mean=True)
    np.testing.assert_allclose(out["g"][1:], 60000.0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_cast_payload_stays_16_bit_in_hlo(mesh, dtype):
    """XLA may move a convert across a collective or promote a 16-bit all-reduce to f32."""
    hlo_dtype = "u16"  # the payload's raw bits; a float convert would be moved by XLA
    tree = {"g": jax.ShapeDtypeStruct((2**16,), jnp.float32)}
    for ef in (False, True):
        comp = jc.Cast(dtype, error_feedback=ef)
        text = pmean_hlo(mesh, tree, comp)
        ops = collectives_in_hlo(text)
        assert {o.op for o in ops} == {"all-to-all", "all-gather"}, [o.line for o in ops]
        assert {d for o in ops for d in o.dtypes} == {hlo_dtype}, [o.line for o in ops]
        assert wire_bytes(exact_pmean_hlo(mesh, tree)) / wire_bytes(text) >= 1.99
    # Scatter and gather too.
    comp = jc.Cast(dtype)

    def body(t, s):
        shards, _ = jc.compressed_psum_scatter(t, None, axis_name="dp", compressor=comp)
        full, _ = jc.compressed_all_gather(shards, None, axis_name="dp", compressor=comp, like=t)
        return full, s

    ops = collectives_in_hlo(compiled(mesh, tree, body))
    assert {o.op for o in ops} == {"all-to-all", "all-gather"}
    assert {d for o in ops for d in o.dtypes} == {hlo_dtype}


def test_cast_scatter_gather_match_exact_within_rounding(mesh):
    comp = jc.Cast(jnp.bfloat16)
    tree = stacked(800, {"a": (40, 3)})

    def body(t):
        t = local(t)
        shards, _ = jc.compressed_psum_scatter(t, None, axis_name="dp", compressor=comp)
        exact = lax.psum_scatter(t["a"].reshape(N, -1), "dp", tiled=False)
        full, _ = jc.compressed_all_gather(shards, None, axis_name="dp", compressor=comp, like=t)
        return shards["a"], exact, full["a"]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))
    shards, exact, full = fn(tree)
    np.testing.assert_allclose(shards, exact.reshape(-1), rtol=2e-2, atol=2e-2)
    want = np.asarray(shards).astype(jnp.bfloat16).astype(np.float32).reshape(40, 3)
    np.testing.assert_array_equal(np.asarray(full).reshape(N, 40, 3)[3], want)


def test_cast_rejects_other_dtypes():
    with pytest.raises(ValueError, match="Cast"):
        jc.Cast(jnp.int8)
    with pytest.raises(ValueError, match="Cast"):
        jc.Cast(jnp.float32)


# --------------------------------------------------------------------------------------------
# PowerSGD
# --------------------------------------------------------------------------------------------

PSGD_SHAPES = {"a": (24, 16), "b": (16,), "c": (8, 3, 10), "d": (3, 3)}  # b, d sent exactly


def low_rank_trees(seed, steps, n=N):
    """Gradients near rank 2 plus noise, so a rank-2 approximation is meaningful."""
    rng = np.random.default_rng(seed)
    base = {
        k: rng.normal(size=(s[0], 2)) @ rng.normal(size=(2, int(np.prod(s[1:]))))
        if len(s) >= 2
        else rng.normal(size=s)
        for k, s in PSGD_SHAPES.items()
    }
    return [
        {
            k: (base[k].reshape(s) + 0.1 * rng.normal(size=(n, *s))).astype(np.float32)
            for k, s in PSGD_SHAPES.items()
        }
        for _ in range(steps)
    ]


def flat_tree(tree, n=N):
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(n, -1) for k in sorted(tree)], 1)


@pytest.mark.parametrize("warm_start", [True, False])
def test_powersgd_matches_numpy_model(mesh, warm_start):
    from tests.reference import powersgd_reference as pref

    comp = jc.PowerSGD(rank=2, warm_start=warm_start, seed=3)
    trees = low_rank_trees(900, 4)
    outs, states = reduce_steps(mesh, trees, comp)
    shapes = [PSGD_SHAPES[k] for k in sorted(PSGD_SHAPES)]
    plan = pref.leaf_matrices(shapes, 2, 2.0)
    assert [r for *_, r in plan] == [2, 0, 2, 0]

    def drawn_qs(step):  # the documented shared draw: normal(fold_in(fold_in(key, t), leaf))
        key = jax.random.fold_in(jax.random.PRNGKey(3), step)
        return [
            np.asarray(jax.random.normal(jax.random.fold_in(key, i), (cols, r)))
            for i, (_, cols, r) in enumerate(plan)
            if r
        ]

    model = pref.PowerSGDModel(N, shapes, 2, initial_qs=drawn_qs(0))
    for t, (tree, out) in enumerate(zip(trees, outs, strict=True)):
        expected = model.step(flat_tree(tree), qs=None if warm_start else drawn_qs(t))
        got = np.concatenate([np.asarray(out[k]).reshape(-1) for k in sorted(out)])
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)
    # Error feedback: e = c - mean on every device (the model's errors are per device).
    final = np.asarray(states[-1].buckets[0].error).reshape(N, -1)
    np.testing.assert_allclose(final, model.errors, rtol=2e-4, atol=2e-4)


def test_powersgd_exact_on_low_rank_data_and_psum(mesh):
    """A rank-1 gradient shared by all devices is reproduced exactly by rank 1 (one step)."""
    rng = np.random.default_rng(5)
    g = np.outer(rng.normal(size=32), rng.normal(size=20)).astype(np.float32)
    tree = {"w": np.stack([g] * N), "v": rng.normal(size=(N, 5)).astype(np.float32)}
    (out,), _ = reduce_steps(mesh, [tree], jc.PowerSGD(rank=1), mean=False)
    np.testing.assert_allclose(out["w"], N * g, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["v"], tree["v"].sum(0), rtol=1e-5, atol=1e-5)


def test_powersgd_hlo_two_small_all_reduces(mesh):
    tree = {
        "w": jax.ShapeDtypeStruct((512, 512), jnp.float32),
        "b": jax.ShapeDtypeStruct((512,), jnp.float32),
    }
    text = pmean_hlo(mesh, tree, jc.PowerSGD(rank=4))
    ops = collectives_in_hlo(text)
    assert [o.op for o in ops] == ["all-reduce", "all-reduce"], [o.line for o in ops]
    # P (512 x 4) + exact b (512), then Q (512 x 4): fp32.
    assert sorted(o.payload_bytes for o in ops) == [4 * 512 * 4, 4 * (512 * 4 + 512)]
    ratio = wire_bytes(exact_pmean_hlo(mesh, tree)) / wire_bytes(text)
    assert ratio >= 50, ratio


def test_powersgd_scatter_is_the_all_reduce_sliced(mesh):
    comp = jc.PowerSGD(rank=2)
    tree = low_rank_trees(950, 1)[0]
    like = local(tree)
    s_red = jc.init_state(comp, like, axis_size=N)
    s_sc = jc.init_state(comp, like, axis_size=N, op="reduce_scatter")
    np.testing.assert_array_equal(s_red.buckets[0].q, s_sc.buckets[0].q)

    def body(t, s1, s2):
        t = local(t)
        full, _ = jc.compressed_pmean(t, s1, axis_name="dp", compressor=comp)
        shards, _ = jc.compressed_pmean_scatter(t, s2, axis_name="dp", compressor=comp)
        mine = jax.tree.map(
            lambda x, sh: jnp.pad(x.reshape(-1), (0, N * sh.shape[0] - x.size)).reshape(N, -1)[
                lax.axis_index("dp")
            ],
            full,
            shards,
        )
        return shards, mine

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("dp"), P("dp"), P("dp")), out_specs=(P("dp"), P("dp"))
        )
    )
    shards, mine = fn(tree, global_state(s_red), global_state(s_sc))
    for k in shards:
        np.testing.assert_allclose(shards[k], mine[k], rtol=1e-6, atol=1e-6)


def test_powersgd_rejects_bad_config():
    with pytest.raises(ValueError, match="rank"):
        jc.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="min_compression_rate"):
        jc.PowerSGD(min_compression_rate=0.5)


# --------------------------------------------------------------------------------------------
# TopK
# --------------------------------------------------------------------------------------------


def topk_model(bufs: np.ndarray, k: int):
    """Per row: the k largest |v| (stable order), the residual with them zeroed, and the sum."""
    rows = np.asarray(bufs, np.float64)
    idx = np.argsort(-np.abs(rows), axis=-1, kind="stable")[..., :k]
    sent = np.zeros_like(rows)
    np.put_along_axis(sent, idx, np.take_along_axis(rows, idx, -1), -1)
    return sent, rows - sent


@pytest.mark.parametrize("error_feedback", [True, False])
def test_topk_all_reduce_matches_numpy_model(mesh, error_feedback):
    numel, frac = 700, 0.05
    comp = jc.TopK(fraction=frac, error_feedback=error_feedback)
    trees = [stacked(1000 + k, {"g": (numel,)}) for k in range(4)]
    outs, states = reduce_steps(mesh, trees, comp)
    k = int(np.ceil(frac * numel))
    err = np.zeros((N, numel))
    for t, (tree, out) in enumerate(zip(trees, outs, strict=True)):
        sent, resid = topk_model(tree["g"] + err, k)
        if error_feedback:
            err = resid
            got_err = np.asarray(states[t + 1].buckets[0].error).reshape(N, numel)
            np.testing.assert_allclose(got_err, err, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out["g"], sent.mean(0), rtol=1e-5, atol=1e-6)
        assert np.count_nonzero(out["g"]) <= N * k


def test_topk_reduce_scatter_matches_numpy_model(mesh):
    comp = jc.TopK(fraction=0.25)
    tree = stacked(1100, {"g": (8 * 12,)})
    state = jc.init_state(comp, local(tree), axis_size=N, op="reduce_scatter")
    fn = jax.jit(
        jax.shard_map(
            lambda t, s: jc.compressed_psum_scatter(local(t), s, axis_name="dp", compressor=comp),
            mesh=mesh,
            in_specs=(P("dp"), P("dp")),
            out_specs=(P("dp"), P("dp")),
        )
    )
    out, new = fn(tree, global_state(state))
    rows = tree["g"].reshape(N, N, 12)  # [device, destination rank, C]
    sent, resid = topk_model(rows, 3)
    np.testing.assert_allclose(np.asarray(out["g"]).reshape(N, 12), sent.sum(0), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(new.buckets[0].error).reshape(N, N, 12), resid, rtol=1e-6, atol=1e-7
    )


def test_topk_hlo_pairs_and_cost_model(mesh):
    numel, frac = 2**16, 0.01
    tree = {"g": jax.ShapeDtypeStruct((numel,), jnp.float32)}
    text = pmean_hlo(mesh, tree, jc.TopK(fraction=frac))
    ops = collectives_in_hlo(text)
    assert {o.op for o in ops} == {"all-gather"}
    assert {d for o in ops for d in o.dtypes} == {"f32", "s32"}
    k = int(np.ceil(frac * numel))
    assert wire_bytes(text) == pytest.approx(8 * (N - 1) * k)  # the documented cost model
    ratio = wire_bytes(exact_pmean_hlo(mesh, tree)) / wire_bytes(text)
    assert ratio == pytest.approx(1 / (N * frac), rel=0.01)


def test_topk_rejects_bad_fraction():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="TopK"):
            jc.TopK(fraction=bad)


# --------------------------------------------------------------------------------------------
# Every compressor: pmap, check_vma=False and non-finite input
# --------------------------------------------------------------------------------------------

FAMILY = [
    jc.Quantize(bits=4, block_size=32, error_feedback=True),
    jc.Cast(jnp.float16, error_feedback=True),
    jc.TopK(fraction=0.1),
    jc.PowerSGD(rank=2),
]


@pytest.mark.parametrize("comp", FAMILY, ids=lambda c: type(c).__name__)
def test_family_pmap_and_unchecked_shard_map_match_shard_map(mesh, comp):
    tree = stacked(1200, {"w": (16, 12), "b": (5,)})
    state = jc.init_state(comp, local(tree), axis_size=N)
    (want,), (_, want_state) = reduce_steps(mesh, [tree], comp)
    step = jax.pmap(
        lambda t, s: jc.compressed_pmean(t, s, axis_name="i", compressor=comp), axis_name="i"
    )
    out, new_state = step(tree, jax.tree.map(lambda s: jnp.stack([s] * N), state))
    unchecked = jax.jit(
        jax.shard_map(
            lambda t, s: jc.compressed_pmean(local(t), s, axis_name="dp", compressor=comp),
            mesh=mesh,
            in_specs=(P("dp"), P("dp")),
            out_specs=(P(), P("dp")),
            check_vma=False,
        )
    )
    out2, _ = unchecked(tree, global_state(state))
    for k in tree:
        for d in range(N):
            np.testing.assert_allclose(out[k][d], want[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out2[k], want[k], rtol=1e-5, atol=1e-6)
    for got, ref in zip(
        jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True
    ):  # pmap stacks per-device states; shard_map concatenates them
        np.testing.assert_allclose(
            np.asarray(got).reshape(-1), np.asarray(ref).reshape(-1), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("comp", FAMILY, ids=lambda c: type(c).__name__)
def test_family_nonfinite_input_gives_nonfinite_output(mesh, comp):
    tree = stacked(1300, {"w": (16, 12)})
    tree["w"][2, 3, 4] = np.nan
    (out,), _ = reduce_steps(mesh, [tree], comp)
    assert not np.all(np.isfinite(out["w"]))
