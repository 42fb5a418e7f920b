"""jaxcomm.fusion: the same values on every backend, a select or a barrier only on GPU, where it
is the cheaper program (lowered for GPU and TPU without one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxcomm as jc
from jaxcomm import fusion
from jaxcomm.fusion import apart_on_cpu, write_or_keep, written_once


def _write(x, old):
    return {"a": x * 2.0, "b": old["b"] + x}


def _keep(x, old):
    return old


def _old():
    return {"a": jnp.full((5,), -1.0), "b": jnp.arange(5.0)}


@pytest.mark.parametrize("finite", [True, False])
def test_write_or_keep_gives_the_conditional_values(finite):
    x = jnp.linspace(-1.0, 1.0, 5)
    ok = jnp.asarray(finite)
    got = jax.jit(lambda ok, x, old: write_or_keep(ok, _write, _keep, x, old))(ok, x, _old())
    want = lax.cond(ok, _write, _keep, x, _old())
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    if not finite:  # the kept values exactly, even where the written ones are NaN
        nan = jnp.full((5,), jnp.nan)
        got = jax.jit(lambda ok, x, old: write_or_keep(ok, _write, _keep, x, old))(ok, nan, _old())
        np.testing.assert_array_equal(np.asarray(got["a"]), -np.ones(5))


def _lowered(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_a_select_on_gpu_a_conditional_on_cpu_and_tpu():
    args = (jnp.asarray(True), jnp.ones(5), _old())

    def fn(ok, x, old):
        return write_or_keep(ok, _write, _keep, x, old)

    for platform in ("cpu", "tpu"):
        assert "stablehlo.select" not in _lowered(fn, *args, platform=platform)
    assert "conditional(" in jax.jit(fn).lower(*args).compile().as_text()
    # Two selects (the leaves); the only cases left are lax.platform_dependent's own, on a
    # constant index, which XLA folds.
    assert _lowered(fn, *args, platform="cuda").count("stablehlo.select ") == 2


def test_written_once_is_a_barrier_on_gpu_only():
    def fn(x):
        (y,) = written_once(x * 2.0)
        return y + 1.0, y * 3.0

    x = jnp.arange(4.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)[1]), np.arange(4.0) * 6.0)
    assert "optimization_barrier" not in _lowered(fn, x, platform="cpu")
    assert "optimization_barrier" not in _lowered(fn, x, platform="tpu")
    assert "optimization_barrier" in _lowered(fn, x, platform="cuda")


def test_apart_on_cpu_is_a_barrier_on_cpu_only():
    def fn(x):
        (y,) = apart_on_cpu(x)
        return y * 2.0

    x = jnp.arange(4.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)), np.arange(4.0) * 2.0)
    assert "optimization_barrier" in _lowered(fn, x, platform="cpu")
    assert "optimization_barrier" not in _lowered(fn, x, platform="tpu")
    assert "optimization_barrier" not in _lowered(fn, x, platform="cuda")


@pytest.fixture
def gpu_forms(monkeypatch):
    """The GPU forms on CPU: every helper takes its GPU branch whatever the backend."""
    monkeypatch.setattr(fusion, "_on_gpu_else", lambda *ops, gpu, other: gpu(*ops))


def test_gpu_forms_run_on_cpu(gpu_forms):
    x, old = jnp.linspace(-1.0, 1.0, 5), _old()
    for ok in (True, False):
        got = jax.jit(lambda ok, x, old: write_or_keep(ok, _write, _keep, x, old))(ok, x, old)
        want = lax.cond(ok, _write, _keep, x, old)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    fn = jax.jit(lambda x: written_once(x * 2.0)[0] + 1.0)
    assert "optimization_barrier" in fn.lower(x).as_text()


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb", "diloco"])
def test_optimizers_give_the_same_bits_with_the_gpu_forms(name, monkeypatch):
    # The programs compiled for a GPU keep a skipped step's state by selects, exchange the
    # compressed collectives' verdicts before their payloads and write OneBit's input once:
    # run on CPU, a schedule with non-finite steps (warm-up and
    # compressed) gives the CPU forms' parameters and state bit for bit (1-bit Adam, 1-bit
    # LAMB and DiLoCo: to fp32 rounding, see below).
    from tests.optim.test_optim_robustness import BUILDERS, poisoned
    from tests.optim.test_optimizers import grad_steps, run

    builders = dict(BUILDERS)
    builders["diloco"] = lambda: jc.diloco(
        optax.adam(0.02), optax.sgd(0.7, momentum=0.9, nesterov=True), 3, "dp",
        compressor=jc.Quantize(4, error_feedback=True),
    )  # fmt: skip

    clean = grad_steps(11, seed=5)
    steps = clean[:2] + [poisoned(clean[2], np.nan)] + clean[2:7]
    steps += [poisoned(clean[7], np.inf)] + clean[7:]
    want, want_state = run(builders[name](), steps, phased=True)
    monkeypatch.setattr(fusion, "_on_gpu_else", lambda *ops, gpu, other: gpu(*ops))
    got, got_state = run(builders[name](), steps, phased=True)
    for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state)),
                    strict=True):  # fmt: skip
        a, b = np.asarray(a), np.asarray(b)
        # On GPU 1-bit Adam reads its momentum decoded from the packed mean inside the fused
        # step (elsewhere the stored copy, the same values): XLA may reassociate the products
        # around the decode, so the runs agree to fp32 rounding, not bit for bit, and a
        # momentum within rounding of zero may be sent with the other sign (the packed mean,
        # uint8, is checked against the momentum in tests/optim/test_onebit_adam_packed.py).
        # 1-bit LAMB's warm-up on GPU computes the trust ratio's norms from the moments
        # recomputed behind a barrier, and the step from the moments it writes: two fusions
        # that may round the same expression differently, so again to fp32 rounding. DiLoCo's
        # int4 sync on GPU decides before the exchange and writes the residual in the pass
        # that writes the codes, where XLA may contract ``buf - levels * inv`` into one
        # multiply-add: to fp32 rounding as well.
        if name == "onebit_adam" and a.dtype == np.uint8:
            continue
        if name != "zero_one_adam" and np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("forms", ["cpu", "gpu"])
def test_a_per_device_verdict_over_replicated_values_under_check_vma(forms, mesh, monkeypatch):
    # A guard whose verdict varies by device (a worker's own probe) over a replicated value
    # (an all-reduced mean): a select would type the result device-varying where the
    # conditional keeps it replicated, so the GPU form takes the conditional there; both forms
    # must trace (every backend traces both) and each device keeps or writes by its own verdict.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if forms == "gpu":
        monkeypatch.setattr(fusion, "_on_gpu_else", lambda *ops, gpu, other: gpu(*ops))
    n = mesh.shape["dp"]

    def body(local):
        mean = lax.pmean(jnp.sum(local), "dp") * jnp.ones(3)  # replicated
        finite = jnp.sum(local) > 0  # varies by device
        out = write_or_keep(finite, lambda m: m + 1.0, lambda m: jnp.zeros_like(m), mean)
        return lax.pcast(out, "dp", to="varying")[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))
    local = jnp.arange(n, dtype=jnp.float32) - 2.0  # devices 0..2 keep, 3.. write
    got = np.asarray(fn(jax.device_put(local, NamedSharding(mesh, P("dp")))))
    mean = float(np.mean(np.asarray(local)))
    want = np.where((np.asarray(local) > 0)[:, None], mean + 1.0, 0.0) * np.ones((n, 3))
    np.testing.assert_array_equal(got, want)
