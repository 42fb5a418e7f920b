"""The runnable examples in examples/: each main() with a few steps, checked against references."""

import importlib.util
import pathlib

import jax
import numpy as np
import optax
import pytest

import jaxcomm as jc
from jaxcomm.cli.textdata import CharBatches

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
# Every character of the vocabulary has been seen by step 16 of the examples' batches: 1-bit
# Adam needs that before it freezes the variance (a zero variance row blows up).
STEPS, WARMUP = 30, 20


def load(name: str):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"jaxcomm_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EPS32 = float(np.finfo(np.float32).eps)


def flatten(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def assert_params_close(got, want, *, start, steps: int = STEPS):
    """``got`` is ``want`` up to fp32 rounding accumulated over ``steps`` Adam steps.

    Two runs of the same algorithm that sum the same gradients in another order (8 device means
    vs one full batch; another CPU's vector width) differ per step by a few ulps in the gradient.
    Adam divides by ``sqrt(v)``, so on coordinates whose gradient is nearly zero that relative
    error is amplified and one parameter out of many can differ by 5e-5 relative (measured on an
    AMD EPYC), which an elementwise ``rtol`` cannot absorb. Over the whole tree the error is
    bounded instead: we allow ``100 * eps`` of the distance travelled per step (the amplification
    plus ~10 rounding steps of a sum), accumulated linearly over ``steps``. The distance is
    measured from ``start``, the common initial parameters. Measured here: 2.5e-7 of the
    distance (the bound is 3.6e-4); a mean missing one device's examples gives 0.18.
    """
    g, w, s = (flatten(t) for t in (got, want, start))
    assert np.all(np.isfinite(g)), "non-finite parameters"
    travelled = np.linalg.norm(w - s)
    error = np.linalg.norm(g - w)
    bound = steps * 100 * EPS32 * travelled
    assert error <= bound, f"|got - want| = {error:.3g} > {bound:.3g} after {steps} steps"


def assert_trains(losses):
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.05, losses


@pytest.fixture(scope="module")
def optax_run():
    return load("optax_shard_map").main(steps=STEPS, warmup=WARMUP, log=None)


@pytest.fixture(scope="module")
def pmap_run():
    return load("pmap").main(steps=STEPS, warmup=WARMUP, log=None)


def reference_adam(example, steps: int = STEPS):
    """``optax.adam`` on one device and the whole global batch of each of the example's steps:
    the model, batches and learning rate rebuilt from the example's own constants."""
    data = CharBatches.from_corpus(context=example.CONTEXT)
    rng = np.random.default_rng(0)
    n = jax.device_count()
    batches = [data.sample(rng, (n * example.BATCH_PER_DEVICE,)) for _ in range(steps)]
    params = example.init_params(data.vocab_size)
    tx = optax.adam(example.LR)

    @jax.jit
    def step(p, s, batch):
        loss, grads = jax.value_and_grad(example.loss_fn)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    p, s, losses = params, tx.init(params), []
    for batch in batches:
        p, s, loss = step(p, s, batch)
        losses.append(float(loss))
    return params, p, losses


def test_optax_shard_map_example(optax_run):
    out = optax_run
    for losses in out["losses"].values():
        assert_trains(losses)
    # The exact run is optax.adam on the full batch, up to fp32 rounding (see assert_params_close).
    start, want, losses = reference_adam(load("optax_shard_map"))
    np.testing.assert_allclose(out["losses"]["exact"], losses, rtol=STEPS * 10 * EPS32)
    assert_params_close(out["states"]["exact"].params, want, start=start)
    # The hand-written shard_map step trains as make_train_step does: same losses and
    # parameters up to the same fp32 rounding growth (they may compile to different programs).
    mine, theirs = out["states"]["onebit_adam, by hand"], out["states"]["onebit_adam"]
    np.testing.assert_allclose(
        out["losses"]["onebit_adam, by hand"], out["losses"]["onebit_adam"], rtol=STEPS * 10 * EPS32
    )
    assert_params_close(mine.params, theirs.params, start=start)
    # A different algorithm on the same batches is far outside that bound.
    with pytest.raises(AssertionError):
        assert_params_close(out["states"]["1-bit mean + adam"].params, theirs.params, start=start)
    # Compressed steps (HLO bytes of the two-stage program minus the exact program) send the
    # same 1-bit mean of a parameter-shaped tree for both transformations, >= 25x less than fp32;
    # onebit_adam sends nothing more: its skip decision is read from the replicated mean (one
    # element per leaf: OneBit's guarded output is NaN or finite as a whole), no pmin.
    compressed = out["compressed_step_bytes"]
    assert compressed["onebit_adam"] == compressed["1-bit mean + adam"]
    assert 25 * compressed["onebit_adam"] < out["step_bytes"]["exact"]


def test_pmap_example(pmap_run, optax_run):
    out = pmap_run
    for losses in out["losses"].values():
        assert_trains(losses)
    # pmean + adam is optax.adam on the full batch; the hand-written pmap step and
    # make_pmap_train_step train alike (losses to fp32 rounding over STEPS steps).
    _, _, losses = reference_adam(load("pmap"))
    rtol = STEPS * 10 * EPS32
    np.testing.assert_allclose(out["losses"]["pmean + adam"], losses, rtol=rtol)
    np.testing.assert_allclose(
        out["losses"]["onebit_adam, by hand"], out["losses"]["onebit_adam"], rtol=rtol
    )
    assert 25 * out["compressed_step_bytes"] < out["step_bytes"]["pmean + adam"]
    # Same model, data and optimizer as the shard_map example, another compiled program: the
    # same training up to fp32 rounding growth over the steps (assert_params_close's bound, 2e-3
    # here; a rounding difference that flips one 1-bit sign moves a coordinate by ~2 lr / n =
    # 7.5e-4). Losses: ~10 roundings per step.
    np.testing.assert_allclose(
        out["losses"]["onebit_adam"], optax_run["losses"]["onebit_adam"], rtol=rtol
    )
    got = jc.from_pmap_layout(out["state"])
    start = load("pmap").init_params(CharBatches.from_corpus().vocab_size)
    assert_params_close(got.params, optax_run["states"]["onebit_adam"].params, start=start)
    # The pmap state converts to the shard_map layout: same structure, shapes and step count.
    want_state = optax_run["states"]["onebit_adam"].opt_state
    assert jax.tree.structure(got.opt_state) == jax.tree.structure(want_state)
    for x, y in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want_state), strict=True):
        assert np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
    assert int(np.asarray(got.opt_state.count).reshape(-1)[0]) == STEPS
    other = optax_run["states"]["1-bit mean + adam"].params  # another algorithm: far outside
    with pytest.raises(AssertionError):
        assert_params_close(got.params, other, start=start)


def test_flax_nnx_example():
    """NNX + jc.compressed_mean: exact mean == optax.adam on the full batch; 1-bit trains."""
    example = load("flax_nnx")
    from flax import nnx

    compressors = {"exact": jc.NoCompression(), "1-bit": jc.OneBit()}
    out = example.main(steps=STEPS, warmup=WARMUP, log=None, compressors=compressors)
    exact, onebit = out["losses"]["exact"], out["losses"]["1-bit"]
    assert_trains(exact)
    assert_trains(onebit)
    # The 1-bit run is exact during warm-up (the loss is that of the parameters before the
    # update), then its error-feedback state (per device, through split/merge) takes over.
    np.testing.assert_allclose(onebit[: WARMUP + 1], exact[: WARMUP + 1], rtol=1e-6)
    assert onebit[-1] != exact[-1]
    step_bytes = out["step_bytes"]
    assert 25 * (step_bytes["1-bit"] - step_bytes["exact"]) < step_bytes["exact"]

    graphdef, params = nnx.split(example.CharMLP(out["vocab"], nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(example.LR)
    opt_state = tx.init(params)

    @jax.jit
    def reference_step(params, opt_state, batch):  # one device, the whole global batch
        loss, grads = jax.value_and_grad(lambda p: example.loss_fn(nnx.merge(graphdef, p), batch))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def reference(batches):
        p, s, losses = params, opt_state, []
        for batch in batches:
            p, s, loss = reference_step(p, s, batch)
            losses.append(float(loss))
        return p, losses

    want, losses = reference(out["batches"])
    # Each step's loss is computed before that step's update, from parameters that differ only
    # by rounding: ~10 fp32 rounding steps (sums over 256 examples, in another order).
    np.testing.assert_allclose(out["losses"]["exact"], losses, rtol=STEPS * 10 * EPS32)
    got = nnx.state(out["models"]["exact"], nnx.Param)
    assert_params_close(got, want, start=params)
    # The same check catches a mean that misses one device's examples (a real bug).
    per_device = out["batches"][0][0].shape[0] // jax.device_count()
    dropped, _ = reference([(x[per_device:], y[per_device:]) for x, y in out["batches"]])
    with pytest.raises(AssertionError):
        assert_params_close(dropped, want, start=params)


def test_optax_example_compares_bits_and_names_divergence():
    """A diverged run's NaN parameters are the same bits in both runs, not a mismatch."""
    example = load("optax_shard_map")
    nan = np.array([np.nan, 1.0], np.float32)
    assert example.bit_for_bit({"w": nan}, {"w": nan.copy()})
    assert not example.bit_for_bit({"w": nan}, {"w": np.array([np.nan, 2.0], np.float32)})
    assert not example.bit_for_bit({"w": nan}, {"w": nan.astype(np.float64)})
    assert example.diverged_at([4.0, 3.0, np.nan, np.nan]) == 3
    assert example.diverged_at([4.0, 3.0, 2.5]) is None
