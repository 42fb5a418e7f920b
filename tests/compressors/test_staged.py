"""The staged codec: a compressor written as its codec alone works in every transport.

``GridCodec`` (defined here, nowhere in the package) rounds values to a grid of step ``h`` (a
power of two: its sums are exact in fp32), with both residuals. Its reference is a NumPy
model of the stages (worker, all_to_all, server, all_gather); it runs unchanged in one program
over one axis, over a tuple of axes (exact inside, staged across the slow axis) and in DiLoCo's
background sync (device programs around host exchanges), which must give the single program's
state bit for bit. The guard's verdict from Quantize's scales is checked against the decoded
values themselves.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomm as jc
from jaxcomm.compressors import StagedCodec, TwoStageState, guarded_finish
from jaxcomm.compressors.buckets import plan_buckets
from jaxcomm.compressors.staged import WorkerOut
from tests.conftest import run_sharded

H = 2.0**-6


@dataclass(frozen=True)
class GridCodec(StagedCodec):
    """``round(x / h)`` as int32 codes, pre-divided by ``n`` at the worker stage."""

    error_feedback: bool = True

    def chunk_layout(self, chunk_numel):
        return -(-chunk_numel // 4), 4  # blocks of 4: the padding is exercised

    def encode(self, blocks, divisor):
        codes = jnp.round(blocks / divisor / H).astype(jnp.int32)
        return (codes,), codes.astype(jnp.float32) * H * divisor

    def reduce(self, received, axis_size):
        return jnp.sum(self.decode(received), axis=0)

    def decode(self, wire):
        return wire[0].astype(jnp.float32) * H


def numpy_grid_mean(xs, worker_errors, server_errors):
    """The stages in NumPy (float64 then rounded like fp32; every value is on the grid or a
    small float): ``xs`` ``(n, N)``; residuals ``(n, n c)`` and ``(n, c)``."""
    n, numel = xs.shape
    chunk = server_errors.shape[1]
    bufs = np.zeros((n, n * chunk), np.float32)
    bufs[:, :numel] = xs
    bufs = bufs + worker_errors
    codes = np.round(bufs / n / H)
    new_worker = bufs - (codes * H * n).astype(np.float32)
    rows = codes.reshape(n, n, chunk)  # [source, destination chunk, element]
    chunks = rows.sum(axis=0) * H + server_errors  # device r's chunk r
    server_codes = np.round(chunks / H)
    new_server = chunks - server_codes * H
    mean = (server_codes * H).reshape(-1)[:numel]
    return mean.astype(np.float32), new_worker.astype(np.float32), new_server.astype(np.float32)


def test_a_codec_written_in_the_test_runs_in_one_program_as_its_numpy_model(mesh):
    n, numel = 8, 37
    codec = GridCodec()
    rng = np.random.default_rng(0)
    state = jc.init_state(codec, [jnp.zeros((numel,), jnp.float32)], axis_size=n)
    state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *x.shape)).copy(), state)

    def step(tree, s):
        local = jax.tree.map(lambda x: x[0], s)
        out, new = jc.compressed_pmean([tree[0][0]], local, axis_name="dp", compressor=codec)
        return out[0], jax.tree.map(lambda x: x[None], new)

    worker = np.zeros((n, state.buckets[0].worker_error.shape[1]), np.float32)
    server = np.zeros((n, state.buckets[0].server_error.shape[1]), np.float32)
    for _ in range(3):  # error feedback carries over
        xs = rng.standard_normal((n, numel)).astype(np.float32)
        out, state = run_sharded(step, mesh, [xs], state)
        want, worker, server = numpy_grid_mean(xs, worker, server)
        np.testing.assert_array_equal(np.asarray(out), want)
        np.testing.assert_array_equal(np.asarray(state.buckets[0].worker_error), worker)
        np.testing.assert_array_equal(np.asarray(state.buckets[0].server_error), server)


def test_a_codec_written_in_the_test_runs_over_a_tuple_of_axes():
    """2 x 4: exact inside ``local``, the grid across ``host``; error within the grid's
    roundings of the exact mean (``n + 1`` half-steps of ``h``, in the units of the mean)."""
    mesh = jax.make_mesh((2, 4), ("host", "local"), axis_types=(AxisType.Auto,) * 2)
    codec, numel = GridCodec(error_feedback=False), 50
    xs = np.random.default_rng(1).standard_normal((8, numel)).astype(np.float32)
    spec = jax.sharding.PartitionSpec(("host", "local"))

    def mean(x):
        out, _ = jc.compressed_pmean(x[0], None, axis_name=("host", "local"), compressor=codec)
        return out[None]

    mapped = jax.shard_map(mean, mesh=mesh, in_specs=spec, out_specs=spec)
    got = np.asarray(jax.jit(mapped)(xs))
    np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # replicated
    np.testing.assert_allclose(got[0], xs.mean(0), rtol=0, atol=3 * H / 2)
    assert np.any(got[0] != xs.mean(0))  # the codec did run


@pytest.mark.parametrize("codec", [GridCodec(), jc.OneBit(), jc.Cast(error_feedback=True)])
def test_a_codec_runs_in_the_background_sync_as_in_one_program(mesh, codec):
    from tests.optim.test_diloco import loss_fn, make_batches, make_params

    def run(background):
        tx = jc.diloco(
            optax.adam(0.01),
            optax.sgd(0.7),
            4,
            "dp",
            compressor=codec,
            overlap_steps=2,
            background=background,
        )
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, make_params())
        for batch in make_batches(12):
            state, _ = step(state, batch)
        diloco = state.opt_state
        return jax.tree.leaves(
            state._replace(opt_state=diloco._replace(local=diloco.local._replace(pending=())))
        )

    for a, b in zip(run(True), run(False), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SPECIALS = (np.inf, -np.inf, np.nan, 3.0e38, -2.0e38, 1.0e-45, 0.0)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_verdict_from_its_scales_equals_the_decoded_mean(bits):
    """The guard's flag equals "some element of the mean's first ``numel`` values is not
    finite" for every block content the codec meets (Inf, NaN, magnitudes whose ``2 absmax``
    overflows, tiny and zero blocks); blocks wholly in the padding are not checked. A mean
    that is not finite is NaN everywhere."""
    codec = jc.Quantize(bits, block_size=8, error_feedback=True)
    n, numel = 2, 37
    blocks, length = codec.chunk_layout(-(-numel // n))
    rng = np.random.default_rng(0)
    zeros = jnp.zeros((n * blocks * length,), jnp.float32)
    worker_probe = jnp.zeros((1,), jnp.float32)  # this device's input: finite
    seen = {True: 0, False: 0}
    for trial in range(60):
        chunks = rng.standard_normal((n, blocks, length)).astype(np.float32)
        if trial % 6 == 5:
            chunks[rng.integers(n), rng.integers(blocks)] = 0.0
        for _ in range(trial % 3):
            r, b, i = rng.integers(n), rng.integers(blocks), rng.integers(length)
            chunks[r, b, i] = SPECIALS[rng.integers(len(SPECIALS))]
        gathered, _ = codec.encode(jnp.asarray(chunks), 1)
        new = TwoStageState(zeros, jnp.zeros((blocks * length,), jnp.float32))
        mean, finite = guarded_finish(
            codec, worker_probe, gathered, numel, (blocks, length), n, new
        )
        decoded = np.asarray(codec.decode(gathered)).reshape(-1)[:numel]
        want = bool(np.all(np.isfinite(decoded)))
        assert bool(finite) == want, (trial, chunks)
        # The mean as decoded, or NaN as a whole.
        np.testing.assert_array_equal(np.asarray(mean), decoded if want else np.nan)
        seen[want] += 1
    assert seen[True] > 5 and seen[False] > 5  # both outcomes exercised


def test_worker_stage_invariant_input_plus_old_error_is_reconstruction_plus_new():
    """``x + e_old == rec + e_new`` at the worker stage, for each staged codec."""
    rng = np.random.default_rng(2)
    n, numel = 4, 45
    x = jnp.asarray(rng.standard_normal(numel).astype(np.float32))
    for codec in (GridCodec(), jc.OneBit(), jc.Quantize(8, block_size=8, error_feedback=True)):
        blocks, length = codec.chunk_layout(-(-numel // n))
        error = jnp.asarray(rng.standard_normal(n * blocks * length).astype(np.float32) / 10)
        out = jc.compressors.worker_stage(codec, x, error, (blocks, length), n)
        assert isinstance(out, WorkerOut)
        buf = np.pad(np.asarray(x), (0, n * blocks * length - numel)) + np.asarray(error)
        _, recon = codec.encode(jnp.asarray(buf).reshape(n, blocks, length), n)
        np.testing.assert_allclose(
            np.asarray(recon).reshape(-1) + np.asarray(out.error), buf, rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("guarded", [False, True])
def test_onebit_fused_forms_equal_its_generic_stages_bit_for_bit(mesh, guarded):
    """OneBit's one-program all-reduce (padding, error add and decoding fused) gives the
    generic stages' mean and residuals, bit for bit, over several steps of error feedback;
    guarded, with a non-finite input at step 2 (the residuals are kept) as well."""
    n, sizes = 8, (37, 64, 3)
    codec = jc.OneBit()
    leaves = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]
    bucket = plan_buckets(leaves, None, codec.compute_dtype)[0]
    numel = sum(sizes)
    init = codec.init_all_reduce_state(numel, n)
    states = {
        k: jax.tree.map(lambda x: np.broadcast_to(x, (n, *x.shape)).copy(), init)
        for k in ("fused", "generic")
    }
    rng = np.random.default_rng(3)

    def run(form, xs, state):
        def body(x, s):
            s = jax.tree.map(lambda a: a[0], s)
            kw = {"axis_name": "dp", "axis_size": n}
            if form == "fused":  # OneBit's overrides
                if guarded:
                    out, new, _ = codec.guarded_all_reduce_bucket(x[0], s, bucket, **kw)
                else:
                    out, new = codec.all_reduce_bucket(x[0], s, bucket, **kw)
            elif guarded:  # the base class's generic stages, on the same codec
                out, new, _ = StagedCodec.guarded_all_reduce_bucket(codec, x[0], s, bucket, **kw)
            else:
                out, new = StagedCodec.all_reduce(codec, x[0], s, **kw)
            return out, jax.tree.map(lambda a: a[None], new)

        return run_sharded(body, mesh, xs, state)

    for step in range(4):
        xs = rng.standard_normal((n, numel)).astype(np.float32)
        if guarded and step == 2:
            xs[5, 10] = np.inf
        outs = {}
        for form in ("fused", "generic"):
            outs[form], states[form] = run(form, xs, states[form])
        np.testing.assert_array_equal(np.asarray(outs["fused"]), np.asarray(outs["generic"]))
        for a, b in zip(*(jax.tree.leaves(states[k]) for k in ("fused", "generic")), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
