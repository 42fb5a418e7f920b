"""compressed_psum/pmean/psum_scatter/all_gather against exact collectives and NumPy models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES, make_mesh, split_over
from tests.reference.onebit_reference import OneBitAllReduceModel, OneBitReduceScatterModel

N = NUM_DEVICES


@pytest.fixture(scope="module", params=["auto", "explicit"])
def mesh(request):
    """Every collective test on an Auto mesh and on JAX's default (Explicit-axis) mesh."""
    if request.param == "auto":
        return jax.make_mesh((N,), ("dp",), axis_types=(AxisType.Auto,))
    return jax.make_mesh((N,), ("dp",))


def per_device_trees(seed: int, shapes: dict, n: int = N, dtypes: dict | None = None):
    """A dict of leaves stacked over devices: leaf k has shape (n, *shapes[k])."""
    rng = np.random.default_rng(seed)
    dtypes = dtypes or {}
    out = {}
    for key, shape in shapes.items():
        dtype = np.dtype(dtypes.get(key, np.float32))
        if dtype == np.bool_:
            out[key] = rng.random((n, *shape)) > 0.5
        elif np.issubdtype(dtype, np.integer):
            out[key] = rng.integers(-50, 50, size=(n, *shape)).astype(dtype)
        else:
            out[key] = rng.normal(size=(n, *shape)).astype(np.float32).astype(dtype)
    return out


def local(tree):
    return jax.tree.map(lambda x: x[0], tree)


def run_stacked(fn, mesh, stacked_tree, state, *, check_vma=True, out_spec=None):
    """shard_map over leading device axis of ``stacked_tree``; state stacked by copies."""
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    global_state = jc.stack_per_device(state, n)

    def body(t, s):
        out, s = fn(local(t), s)
        return out, s

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axis), P(axis)),
        out_specs=(P() if out_spec is None else out_spec, P(axis)),
        check_vma=check_vma,
    )
    return jax.jit(mapped)(split_over(mesh, stacked_tree), split_over(mesh, global_state))


MIXED_SHAPES = {"w": (5, 3), "b": (7,), "s": (), "z": (0, 4), "h": (9,), "i": (4,), "m": (3,)}
MIXED_DTYPES = {"h": jnp.bfloat16, "i": np.int32, "m": np.bool_}


@pytest.mark.parametrize("bucket_bytes", [None, 16])
@pytest.mark.parametrize("mean", [False, True])
def test_no_compression_equals_lax(mesh, bucket_bytes, mean):
    tree = per_device_trees(0, MIXED_SHAPES, dtypes=MIXED_DTYPES)
    comp = jc.NoCompression()
    state = jc.init_state(comp, local(tree), axis_size=N, bucket_bytes=bucket_bytes)
    collective = jc.compressed_pmean if mean else jc.compressed_psum
    exact = lax.pmean if mean else lax.psum

    def fn(t, s):
        out, s = collective(t, s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes)
        ref = jax.tree.map(lambda x: exact(x, "dp"), t)
        return (out, ref), s

    (out, ref), _ = run_stacked(fn, mesh, tree, state)
    for key in tree:
        assert out[key].dtype == ref[key].dtype, key
        assert out[key].shape == ref[key].shape, key
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(ref[key]), err_msg=key)


def test_no_compression_accepts_none_state(mesh):
    tree = per_device_trees(1, {"a": (6,)})

    def fn(t, s):
        out, s2 = jc.compressed_psum(t, None, axis_name="dp", compressor=jc.NoCompression())
        assert s2 is None
        return out, s

    out, _ = run_stacked(fn, mesh, tree, ())
    np.testing.assert_allclose(out["a"], tree["a"].sum(0), rtol=1e-6)


def onebit_steps(mesh, stacked_trees, *, mean=True, bucket_bytes=None):
    """Run compressed_p{mean,sum} for several steps, threading the error state."""
    comp = jc.OneBit()
    n = mesh.shape["dp"]
    state = jc.init_state(comp, local(stacked_trees[0]), axis_size=n, bucket_bytes=bucket_bytes)
    global_state = jc.stack_per_device(state, n)
    collective = jc.compressed_pmean if mean else jc.compressed_psum

    def body(t, s):
        return collective(local(t), s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    )
    outs, states = [], [global_state]
    for tree in stacked_trees:
        out, global_state = step(split_over(mesh, tree), split_over(mesh, global_state))
        outs.append(out)
        states.append(global_state)
    return outs, states


@pytest.mark.parametrize("numel", [1000, 4096, 13])
def test_onebit_matches_numpy_model_over_steps(mesh, numel):
    trees = [per_device_trees(10 + k, {"g": (numel,)}) for k in range(6)]
    outs, _ = onebit_steps(mesh, trees)
    model = OneBitAllReduceModel(N, numel)
    for tree, out in zip(trees, outs, strict=True):
        expected = model.step(tree["g"])
        np.testing.assert_allclose(out["g"], expected, rtol=2e-5, atol=2e-6)


def test_onebit_multi_leaf_tree_and_psum(mesh):
    shapes = {"a": (3, 7), "b": (11,), "c": ()}
    trees = [per_device_trees(20 + k, shapes) for k in range(4)]
    outs, _ = onebit_steps(mesh, trees, mean=False)
    # Tree order of a dict is sorted keys: a, b, c concatenated.
    sizes = {"a": 21, "b": 11, "c": 1}
    model = OneBitAllReduceModel(N, sum(sizes.values()))
    for tree, out in zip(trees, outs, strict=True):
        flat = np.concatenate([tree[k].reshape(N, -1) for k in "abc"], axis=1)
        expected = N * model.step(flat)
        got = np.concatenate([np.asarray(out[k]).reshape(-1) for k in "abc"])
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
        assert out["a"].shape == (3, 7) and out["c"].shape == ()


def test_onebit_error_feedback_invariant_both_stages(mesh):
    """mean_j(x_j + e_w_old_j - e_w_new_j)[chunk r] + e_s_old_r == out[chunk r] + e_s_new_r."""
    numel = 200
    trees = [per_device_trees(30 + k, {"g": (numel,)}) for k in range(3)]
    outs, states = onebit_steps(mesh, trees)
    padded = -(-numel // (8 * N)) * 8 * N
    chunk = padded // N
    for k, (tree, out) in enumerate(zip(trees, outs, strict=True)):
        (old,), (new,) = states[k].buckets, states[k + 1].buckets
        e_w_old = np.asarray(old.worker_error).reshape(N, padded)
        e_w_new = np.asarray(new.worker_error).reshape(N, padded)
        x = np.zeros((N, padded), np.float32)
        x[:, :numel] = tree["g"]
        # Worker stage: x + e_old == C(x + e_old) + e_new, with C(v) = ||v||/sqrt(Np) * sgn(v).
        buf = x + e_w_old
        scale = np.linalg.norm(buf, axis=1, keepdims=True) / np.sqrt(padded)
        np.testing.assert_allclose(buf, scale * np.where(buf >= 0, 1, -1) + e_w_new, atol=1e-5)
        # Server stage, assembled from observable inputs, outputs and states only.
        recon_mean = (x + e_w_old - e_w_new).mean(0).reshape(N, chunk)
        e_s_old = np.asarray(old.server_error).reshape(N, chunk)
        e_s_new = np.asarray(new.server_error).reshape(N, chunk)
        out_full = np.zeros(padded, np.float32)
        out_full[:numel] = out["g"]
        # Padding positions of the output are not returned: compare the real elements.
        lhs = (recon_mean + e_s_old).reshape(-1)[:numel]
        rhs = (out_full.reshape(N, chunk) + e_s_new).reshape(-1)[:numel]
        np.testing.assert_allclose(lhs, rhs, atol=1e-5)


def test_onebit_buckets_match_per_bucket_models(mesh):
    shapes = {"a": (40,), "b": (24,), "c": (17,)}
    trees = [per_device_trees(40 + k, shapes) for k in range(3)]
    # 4-byte floats: a (160 B) alone, then b + c (96 + 68 B) within 200 bytes.
    outs, states = onebit_steps(mesh, trees, bucket_bytes=200)
    assert len(states[0].buckets) == 2
    models = [OneBitAllReduceModel(N, 40), OneBitAllReduceModel(N, 41)]
    for tree, out in zip(trees, outs, strict=True):
        np.testing.assert_allclose(out["a"], models[0].step(tree["a"]), rtol=2e-5, atol=2e-6)
        bc = models[1].step(np.concatenate([tree["b"], tree["c"]], axis=1))
        np.testing.assert_allclose(out["b"], bc[:24], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(out["c"], bc[24:], rtol=2e-5, atol=2e-6)


def test_onebit_low_precision_and_exact_leaves(mesh):
    shapes = {"h": (64,), "f": (32,), "i": (5,), "z": (0,)}
    dtypes = {"h": jnp.bfloat16, "f": np.float16, "i": np.int32}
    tree = per_device_trees(50, shapes, dtypes=dtypes)
    outs, _ = onebit_steps(mesh, [tree])
    out = outs[0]
    assert out["h"].dtype == jnp.bfloat16 and out["f"].dtype == np.float16
    assert out["z"].shape == (0,)
    # Integers are exact; floats of both dtypes go in one fp32 bucket (f, h order).
    np.testing.assert_array_equal(out["i"], tree["i"].mean(0))
    model = OneBitAllReduceModel(N, 96)
    flat = np.concatenate([tree["f"].astype(np.float32), tree["h"].astype(np.float32)], axis=1)
    expected = model.step(flat)
    np.testing.assert_allclose(np.asarray(out["f"], np.float32), expected[:32], rtol=1e-2)
    np.testing.assert_allclose(np.asarray(out["h"], np.float32), expected[32:], rtol=1e-2)


def test_onebit_state_is_finite_on_all_zero_input(mesh):
    tree = {"g": np.zeros((N, 50), np.float32)}
    outs, states = onebit_steps(mesh, [tree, tree])
    assert np.all(outs[-1]["g"] == 0)
    for leaf in jax.tree.leaves(states[-1]):
        assert np.all(np.isfinite(leaf)) and np.all(leaf == 0)


def deepspeed_scatter_reference(stacked_leaves, n, mean):
    """NumPy reduce_scatter_coalesced: device r's slice [r*c, (r+1)*c) of every padded leaf."""
    out = []
    for leaf in stacked_leaves:
        flat = leaf.reshape(n, -1).astype(np.float64)
        size = flat.shape[1]
        c = -(-size // n)
        padded = np.zeros((n, n * c))
        padded[:, :size] = flat
        total = padded.sum(0) / (n if mean else 1)
        out.append(total.reshape(n, c))
    return out


@pytest.mark.parametrize("bucket_bytes", [None, 64])
def test_no_compression_psum_scatter_layout_and_round_trip(mesh, bucket_bytes):
    shapes = {"a": (13,), "b": (2, 3), "c": (), "d": (16,)}
    tree = per_device_trees(60, shapes)
    comp = jc.NoCompression()
    like = local(tree)

    def fn(t, s):
        shards, s = jc.compressed_psum_scatter(
            t, s, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes
        )
        mean_shards, _ = jc.compressed_pmean_scatter(
            t, None, axis_name="dp", compressor=comp, bucket_bytes=bucket_bytes
        )
        full, _ = jc.compressed_all_gather(
            mean_shards, None, axis_name="dp", compressor=comp, like=like, bucket_bytes=bucket_bytes
        )
        return (shards, full), s

    state = jc.init_state(comp, like, axis_size=N, op="reduce_scatter", bucket_bytes=bucket_bytes)
    (shards, full), _ = run_stacked(fn, mesh, tree, state, out_spec=(P("dp"), P()))
    keys = sorted(shapes)
    refs = deepspeed_scatter_reference([tree[k] for k in keys], N, mean=False)
    for key, ref in zip(keys, refs, strict=True):
        c = ref.shape[1]
        np.testing.assert_allclose(np.asarray(shards[key]).reshape(N, c), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(full[key], tree[key].mean(0), rtol=1e-5, atol=1e-6)
        assert full[key].shape == like[key].shape


def test_deepspeed_reduce_scatter_cases_on_two_devices():
    """The cases of DeepSpeed's own test of reduce_scatter_coalesced (n = 2, mean)."""
    mesh2 = make_mesh(2)
    ranks = np.arange(2, dtype=np.float32)
    tree = {
        "a": np.stack([np.full(6, r, np.float32) for r in ranks]),
        "b": np.stack([r * np.arange(0, 6, dtype=np.float32) for r in ranks]),
        "c": np.stack([r * np.arange(6, 9, dtype=np.float32) for r in ranks]),
        "d": np.stack([np.full(1, r, np.float32) for r in ranks]),
    }

    def fn(t, s):
        shards, none = jc.compressed_pmean_scatter(
            t, None, axis_name="dp", compressor=jc.NoCompression()
        )
        assert none is None
        return shards, s

    shards, _ = run_stacked(fn, mesh2, tree, (), out_spec=P("dp"))
    np.testing.assert_allclose(np.asarray(shards["a"]), np.full(6, 0.5))
    np.testing.assert_allclose(np.asarray(shards["b"]), np.array([0, 1, 2, 3, 4, 5]) / 2)
    # c has 3 elements: rank 0 gets [6, 7]/2, rank 1 gets [8]/2 and one zero of padding.
    np.testing.assert_allclose(np.asarray(shards["c"]), np.array([6, 7, 8, 0]) / 2)
    np.testing.assert_allclose(np.asarray(shards["d"]), np.array([0.5, 0.0]))


def test_onebit_psum_scatter_matches_model_and_gathers_exactly(mesh):
    shapes = {"a": (30,), "b": (3, 5)}
    trees = [per_device_trees(70 + k, shapes) for k in range(4)]
    comp = jc.OneBit()
    like = local(trees[0])
    state = jc.init_state(comp, like, axis_size=N, op="reduce_scatter")
    global_state = jc.stack_per_device(state, N)

    def body(t, s):
        shards, s = jc.compressed_psum_scatter(local(t), s, axis_name="dp", compressor=comp)
        full, _ = jc.compressed_all_gather(shards, None, axis_name="dp", compressor=comp, like=like)
        return (shards, full), s

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=((P("dp"), P()), P("dp"))
        )
    )
    c = {"a": 4, "b": 2}  # ceil(30/8), ceil(15/8)
    model = OneBitReduceScatterModel(N, sum(c.values()))
    for tree in trees:
        (shards, full), global_state = step(split_over(mesh, tree), split_over(mesh, global_state))
        rows = []
        for key in ("a", "b"):
            flat = np.zeros((N, N * c[key]), np.float32)
            flat[:, : tree[key][0].size] = tree[key].reshape(N, -1)
            rows.append(flat.reshape(N, N, c[key]))
        expected = N * model.step(np.concatenate(rows, axis=2))  # psum = n * mean
        got = np.concatenate([np.asarray(shards[k]).reshape(N, c[k]) for k in ("a", "b")], axis=1)
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
        # The gather is exact: it reassembles the shards.
        np.testing.assert_allclose(
            np.asarray(full["a"]), np.asarray(shards["a"]).reshape(-1)[:30], rtol=0, atol=0
        )


def test_pmap_matches_shard_map(mesh):
    trees = [per_device_trees(80 + k, {"g": (100,)}) for k in range(3)]
    comp = jc.OneBit()
    state = jc.init_state(comp, local(trees[0]), axis_size=N)
    pstate = jax.tree.map(lambda s: jnp.stack([s] * N), state)
    step = jax.pmap(
        lambda t, s: jc.compressed_pmean(t, s, axis_name="i", compressor=comp), axis_name="i"
    )
    outs, _ = onebit_steps(mesh, trees)
    for tree, expected in zip(trees, outs, strict=True):
        out, pstate = step(tree, pstate)
        np.testing.assert_allclose(out["g"][3], expected["g"], rtol=1e-6, atol=1e-7)


def test_check_vma_off(mesh):
    tree = per_device_trees(90, {"g": (64,)})
    comp = jc.OneBit()
    state = jc.init_state(comp, local(tree), axis_size=N)

    def fn(t, s):
        return jc.compressed_pmean(t, s, axis_name="dp", compressor=comp)

    out, _ = run_stacked(fn, mesh, tree, state, check_vma=False)
    np.testing.assert_allclose(out["g"], OneBitAllReduceModel(N, 64).step(tree["g"]), rtol=2e-5)


@pytest.mark.parametrize("compressor", [jc.NoCompression(), jc.OneBit()])
def test_tuple_of_mesh_axes_is_exact_inside_and_compressed_across(compressor):
    """axis_name=("node", "local") on a 2 x 4 mesh: the exact mean over "local", then each local
    rank's share of it through the compressor across "node" (a OneBit model per share), then
    gathered back; under the default check_vma."""
    S, L, numel = 2, 4, 40
    mesh2d = jax.make_mesh((S, L), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
    axes = ("node", "local")
    trees = [per_device_trees(100 + k, {"g": (numel,)}) for k in range(3)]
    state = jc.init_state(compressor, local(trees[0]), axis_size=(S, L))
    stacked_state = jax.tree.map(lambda s: jnp.stack([s] * N), state)

    def body(t, s):
        s = jax.tree.map(lambda a: a[0], s)
        out, s = jc.compressed_pmean(local(t), s, axis_name=axes, compressor=compressor)
        return out, jax.tree.map(lambda a: a[None], s)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh2d, in_specs=(P(axes), P(axes)), out_specs=(P(), P(axes)))
    )
    c = -(-numel // L)
    models = [OneBitAllReduceModel(S, c) for _ in range(L)]
    for tree in trees:
        out, stacked_state = step(tree, stacked_state)
        if isinstance(compressor, jc.OneBit):
            node_mean = tree["g"].reshape(S, L, numel).mean(1, dtype=np.float32)
            shares = np.pad(node_mean, ((0, 0), (0, L * c - numel))).reshape(S, L, c)
            expected = np.concatenate([models[r].step(shares[:, r]) for r in range(L)])[:numel]
        else:
            expected = tree["g"].mean(0)
        np.testing.assert_allclose(out["g"], expected, rtol=2e-5, atol=1e-6)


def test_vmap_axis_matches_pmap_inside_an_optimizer_cond():
    """jax.vmap(axis_name=...) binds an axis too; 1-bit inside onebit_adam's lax.cond works."""
    grads = per_device_trees(110, {"g": (64,)})["g"]
    tx = jc.onebit_adam(1e-2, freeze_step=1, axis_name="i", axis_size=N)
    params = jnp.zeros(64)

    def three_steps(g):
        state = tx.init(params)
        updates = []
        for _ in range(3):
            u, state = tx.update(g, state, params)
            updates.append(u)
        return jnp.stack(updates)

    by_vmap = jax.vmap(three_steps, axis_name="i")(grads)
    by_pmap = jax.pmap(three_steps, axis_name="i")(grads)
    np.testing.assert_allclose(by_vmap, by_pmap, rtol=1e-5, atol=1e-7)
    assert not np.allclose(by_vmap[:, 2], by_vmap[:, 0])  # the 1-bit steps did something
