"""The runnable examples in examples/: each main() with a few steps, checked against references."""

import importlib.util
import pathlib

import jax
import numpy as np
import optax
import pytest

import jaxcomm as jc

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
# Every character of the vocabulary has been seen by step 16 of the examples' batches: 1-bit
# Adam needs that before it freezes the variance (a zero variance row blows up).
STEPS, WARMUP = 30, 20


def load(name: str):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"jaxcomm_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_trees_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trains(losses):
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.05, losses


@pytest.fixture(scope="module")
def optax_run():
    return load("optax_shard_map").main(steps=STEPS, warmup=WARMUP, log=None)


@pytest.fixture(scope="module")
def pmap_run():
    return load("pmap").main(steps=STEPS, warmup=WARMUP, log=None)


def test_optax_shard_map_example(optax_run):
    out = optax_run
    for losses in out["losses"].values():
        assert_trains(losses)
    # The hand-written shard_map step is what make_train_step does, bit for bit.
    assert out["handwritten_matches"]
    assert_trees_equal(out["states"]["onebit_adam"], out["states"]["onebit_adam, by hand"])
    # Compressed steps (HLO bytes of the two-stage program minus the exact program) send the
    # same 1-bit mean of a parameter-shaped tree for both transformations, >= 25x less than fp32.
    compressed = out["compressed_step_bytes"]
    assert compressed["1-bit mean + adam"] == compressed["onebit_adam"]
    assert 25 * compressed["onebit_adam"] < out["step_bytes"]["exact"]


def test_pmap_example(pmap_run, optax_run):
    out = pmap_run
    for losses in out["losses"].values():
        assert_trains(losses)
    assert out["handwritten_matches"]
    assert 25 * out["compressed_step_bytes"] < out["step_bytes"]["pmean + adam"]
    # Same model, data and optimizer as the shard_map example: the same training, bit for bit.
    assert out["losses"]["onebit_adam"] == optax_run["losses"]["onebit_adam"]
    got = jc.from_pmap_layout(out["state"])
    assert_trees_equal(got, optax_run["states"]["onebit_adam"])


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

    losses = []
    for batch in out["batches"]:
        params, opt_state, loss = reference_step(params, opt_state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(out["losses"]["exact"], losses, rtol=2e-6)
    got = nnx.state(out["models"]["exact"], nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
