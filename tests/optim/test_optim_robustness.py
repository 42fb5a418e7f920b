"""Every communicating optimizer: non-finite steps are skipped, bf16 parameters train.

Issue 13 item 4 / issue 15 item 3: a NaN (or Inf) gradient on one device for ``k`` consecutive
steps, then clean steps, gives bit for bit the parameters of the run that never saw the bad
steps (moments, error feedback and schedules kept; ``state.skips`` counts them), and more than
``max_consecutive_skips`` in a row stop the run with a clear error.

Issue 13 item 6: bf16 parameters and gradients, fp32 moments and error feedback; the bf16 run
follows the fp32 run of the same data.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc
from tests.conftest import NUM_DEVICES
from tests.optim.test_optimizers import SHAPES, flat, grad_steps, init_params, linear_loss, run

N = NUM_DEVICES

BUILDERS = {
    "onebit_adam": lambda **kw: jc.onebit_adam(0.02, freeze_step=3, axis_name="dp", **kw),
    "zero_one_adam": lambda **kw: jc.zero_one_adam(
        0.02,
        var_freeze_step=4,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        axis_name="dp",
        **kw,
    ),
    "onebit_lamb": lambda **kw: jc.onebit_lamb(0.02, freeze_step=3, axis_name="dp", **kw),
    "sharded": lambda **kw: jc.sharded(
        optax.adam(0.02),
        "dp",
        compressor=jc.Quantize(bits=8, error_feedback=True),
        gather_compressor=jc.Quantize(bits=8),
        **kw,
    ),
}


def poisoned(step, value, device=3):
    bad = {k: v.copy() for k, v in step.items()}
    bad["a"][device, 1, 2] = value
    return bad


def skip_counters(opt_state):
    s = opt_state
    return np.asarray(s.skips.consecutive).reshape(-1)[0], np.asarray(s.skips.total).reshape(-1)[0]


# Phased 1-bit Adam: in the step's space its mean is the new momentum, which the collective
# itself keeps on a skip (compressed_pmean_or_fallback). With several buckets (16 bytes: one
# per leaf, at least two) every bucket's error feedback is kept, not only the non-finite one's.
BUILDERS["onebit_adam_buckets"] = lambda **kw: jc.onebit_adam(
    0.02, freeze_step=3, axis_name="dp", bucket_bytes=16, **kw
)
# The other optimizers with one bucket per leaf: a bucket that is finite while another is not
# must still keep its error feedback and moments on the skipped step.
BUCKETED = {
    "zero_one_adam_buckets": lambda **kw: BUILDERS["zero_one_adam"](bucket_bytes=16, **kw),
    "onebit_lamb_buckets": lambda **kw: BUILDERS["onebit_lamb"](bucket_bytes=16, **kw),
    "sharded_buckets": lambda **kw: BUILDERS["sharded"](bucket_bytes=16, **kw),
}
SKIP_CASES = (
    [(name, False) for name in BUILDERS]
    + [(name, False) for name in BUCKETED]
    + [("onebit_adam", True), ("onebit_adam_buckets", True)]
    # Phase-specialised 0/1 Adam reads the guard of its mean alone on its communicating steps.
    + [("zero_one_adam", True), ("zero_one_adam_buckets", True)]
    # Phase-specialised 1-bit LAMB probes only the state its phase changes.
    + [("onebit_lamb", True)]
)


@functools.cache
def shared_step(name, phased=False, dtype=np.float32):
    """One train step and its initial state per optimizer, phasing and dtype, compiled once:
    the clean reference and the poisoned run of a test (and the bf16 test's fp32 run) start
    from copies of the same initial state (``step`` is a function of the state it is given)."""
    build = BUILDERS.get(name) or BUCKETED[name]
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    return jc.make_train_step(
        mesh, "dp", linear_loss, build(), init_params(dtype=dtype), specialize_phases=phased
    )


def run_shared(name, steps, phased=False, dtype=np.float32):
    """``run(BUILDERS[name](), steps, ...)`` on the shared step of ``name``."""
    step, initial = shared_step(name, phased, dtype)
    state = jax.tree.map(jnp.copy, initial)  # the step donates its input
    history = []
    for grads in steps:
        state, _ = step(state, grads)
        history.append(jax.tree.map(np.asarray, state.params))
    return history, state


@pytest.mark.parametrize("name,phased", SKIP_CASES)
def test_nonfinite_steps_are_skipped_exactly(name, phased):
    clean = grad_steps(11, seed=21)
    # Two bad steps in the warm-up / variance stage, three later (local steps for 0/1 Adam).
    steps = (
        clean[:2]
        + [poisoned(clean[2], np.nan), poisoned(clean[3], np.inf)]
        + clean[2:7]
        + [poisoned(clean[7], np.nan)] * 3
        + clean[7:]
    )
    want, _ = run_shared(name, clean, phased=phased)
    got, state = run_shared(name, steps, phased=phased)
    for k in SHAPES:
        np.testing.assert_array_equal(got[-1][k], want[-1][k], err_msg=k)
    assert all(np.all(np.isfinite(p[k])) for p in got for k in SHAPES)
    assert skip_counters(state.opt_state) == (0, 5)


@pytest.mark.parametrize("phased", [False, True])
def test_onebit_lamb_skips_a_finite_gradient_whose_square_overflows(phased):
    # 1e22 on one device: the mean (1.25e21) is finite, its square is not, so v would hold an
    # Inf (where the update is then 0, not non-finite): the step's probe of v skips it.
    clean = grad_steps(7, seed=21)
    steps = clean[:2] + [poisoned(clean[2], 1e22)] + clean[2:5] + [poisoned(clean[5], 1e22)]
    steps += clean[5:]
    want, _ = run_shared("onebit_lamb", clean, phased=phased)
    got, state = run_shared("onebit_lamb", steps, phased=phased)
    for k in SHAPES:
        np.testing.assert_array_equal(got[-1][k], want[-1][k], err_msg=k)
    assert skip_counters(state.opt_state) == (0, 2)


def test_phased_onebit_adam_skips_its_first_compressed_step_exactly():
    # The first compressed step moves the moments into the step's space; skipped, the momentum
    # the collective falls back to is still Adam's (and state.preconditioned stays False).
    clean = grad_steps(7, seed=24)
    steps = clean[:3] + [poisoned(clean[3], np.nan)] + clean[3:]  # freeze_step=3
    want, _ = run_shared("onebit_adam", clean, phased=True)
    got, state = run_shared("onebit_adam", steps, phased=True)
    for k in SHAPES:
        np.testing.assert_array_equal(got[-1][k], want[-1][k], err_msg=k)
    assert skip_counters(state.opt_state) == (0, 1)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_too_many_consecutive_skips_raise(name):
    clean = grad_steps(3, seed=22)
    steps = clean[:1] + [poisoned(clean[1], np.nan)] * 3
    with pytest.raises(Exception, match="consecutive steps"):
        history, _ = run(BUILDERS[name](max_consecutive_skips=2), steps)
        jax.block_until_ready(history)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_bf16_params_follow_fp32(name):
    steps = grad_steps(8, seed=23)
    f32, _ = run_shared(name, steps)
    bf16, state = run_shared(name, steps, dtype=jnp.bfloat16)
    assert all(v.dtype == jnp.bfloat16 for v in bf16[-1].values())
    p0 = flat(init_params(dtype=jnp.bfloat16))

    def final(history):  # 0/1 Adam's parameters are per device: their average
        p = history[-1]
        return flat({k: np.mean(p[k], 0) if name == "zero_one_adam" else p[k] for k in p})

    moved = np.linalg.norm(final(f32) - p0)
    gap = np.linalg.norm(final(bf16) - final(f32))
    assert moved > 0.1 and gap < 0.1 * moved, (moved, gap)
    # Moments and error feedback stay fp32 (sharded: the 1-bit scatter's error feedback; its
    # inner optax.adam keeps moments in the parameters' dtype, as optax does).
    opt = state.opt_state
    fp32_parts = [opt.comm] if name == "sharded" else [opt]
    floats = [
        x
        for part in fp32_parts
        for x in jax.tree.leaves(part)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
