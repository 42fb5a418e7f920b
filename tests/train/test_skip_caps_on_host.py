"""The optimizers' ``max_consecutive_skips`` checked on the host (``make_train_step`` on GPU).

The reference is the in-program check: the same optimizer, the same batches, the same state
values bit for bit, and the run stops past the cap (here from a later call of the step, or
``step.check_skips()``) and not at it. A program checked on the host holds no conditional and
no host callback (what stops the host every step on GPU).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxcomm as jc
from jaxcomm.guard import HostSkipCaps, raise_past_caps, skip_caps_on_host

N = 8
GOOD = (np.ones((2 * N, 8), np.float32), np.zeros((2 * N, 4), np.float32))
BAD = (np.full((2 * N, 8), np.nan, np.float32), np.zeros((2 * N, 4), np.float32))


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), "b": jnp.zeros((4,))}


OPTIMIZERS = {
    "onebit_adam": lambda cap: jc.onebit_adam(
        1e-2, axis_name="dp", freeze_step=2, max_consecutive_skips=cap
    ),
    "zero_one_adam": lambda cap: jc.zero_one_adam(
        1e-2, axis_name="dp", total_steps=40, max_consecutive_skips=cap
    ),
    "diloco": lambda cap: jc.diloco(
        optax.sgd(0.05), optax.sgd(0.7), 2, "dp", max_consecutive_skips=cap
    ),
}


def run(mesh, tx, batches, on_host):
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params(), check_skips_on_host=on_host)
    for batch in batches:
        state, _ = step(state, batch)
    step.check_skips()
    return step, jax.tree.map(np.asarray, state)


def test_a_program_checked_on_host_holds_no_conditional_and_no_host_call(mesh):
    for on_host in (True, False):
        step, state = jc.make_train_step(
            mesh, "dp", loss_fn, OPTIMIZERS["onebit_adam"](16), params(),
            check_skips_on_host=on_host,
        )  # fmt: skip
        hlo = step.lower(state, GOOD).compile().as_text()
        assert ("conditional(" in hlo) is not on_host
        assert bool(re.search(r"custom_call_target=\"\w*python\w*callback", hlo)) is not on_host


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_state_as_the_in_program_check_up_to_the_cap(mesh, name):
    # Two non-finite steps in a row, at the cap (2): skipped, counted, and the run goes on.
    batches = [GOOD] * 3 + [BAD] * 2 + [GOOD] * 3
    _, want = run(mesh, OPTIMIZERS[name](2), batches, on_host=False)
    _, got = run(mesh, OPTIMIZERS[name](2), batches, on_host=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(got.params))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_past_the_cap_the_host_raises(mesh, name):
    # Three in a row past a cap of 2 (DiLoCo compares its inner streaks at its syncs).
    step, state = jc.make_train_step(
        mesh, "dp", loss_fn, OPTIMIZERS[name](2), params(), check_skips_on_host=True
    )
    with pytest.raises(FloatingPointError, match="consecutive steps") as info:
        for batch in [GOOD] * 3 + [BAD] * 4:
            state, _ = step(state, batch)
        step.check_skips()
    assert "max_consecutive_skips=2" in str(info.value) and name in str(info.value)


def test_a_later_call_raises_without_waiting_for_check_skips(mesh):
    step, state = jc.make_train_step(
        mesh, "dp", loss_fn, OPTIMIZERS["onebit_adam"](1), params(), check_skips_on_host=True
    )
    calls = 0
    with pytest.raises(FloatingPointError, match="max_consecutive_skips=1"):
        for batch in [GOOD] * 3 + [BAD] * 2 + [GOOD] * 6:
            calls += 1
            state, _ = step(state, batch)
    # The streak passed the cap at call 5; a call waits for the steps more than
    # max_in_flight (2) behind it, so the error comes within two more calls.
    assert 5 <= calls <= 5 + step.max_in_flight


def test_pmap_step_checks_on_host():
    tx = OPTIMIZERS["onebit_adam"](2)
    step, state = jc.make_pmap_train_step("dp", loss_fn, tx, params(), check_skips_on_host=True)
    with pytest.raises(FloatingPointError, match="onebit_adam skipped 3"):
        for batch in [GOOD] * 3 + [BAD] * 3:
            state, _ = step(state, batch)
        step.check_skips()


def test_only_checks_at_the_steps_own_trace_level_leave_the_program():
    taken = {}

    def f(x):
        with skip_caps_on_host(x) as caps:
            taken["top"] = caps.take(x.astype(jnp.int32), 3, "top")

            def branch(y):
                taken["cond"] = caps.take(y.astype(jnp.int32), 3, "cond")
                return y

            lax.cond(x > 0, branch, branch, x)
            taken["vmap"] = []
            jax.vmap(lambda y: taken["vmap"].append(caps.take(y, 3, "vmap")) or y)(
                jnp.arange(2)
            )
        return caps.report(None)

    report = jax.jit(f)(jnp.float32(5.0))
    assert taken == {"top": True, "cond": False, "vmap": [False]}
    np.testing.assert_array_equal(np.asarray(report), [[[5, 3]]])


def test_raise_past_caps_reads_every_device_row():
    ok = np.array([[[2, 2], [0, 5]], [[1, 2], [0, 5]]], np.int32)  # (devices, caps, 2)
    raise_past_caps(ok, ["a", "b"])
    bad = ok.copy()
    bad[1, 1, 0] = 6
    with pytest.raises(FloatingPointError, match="b skipped 6 consecutive steps"):
        raise_past_caps(bad, ["a", "b"])
    assert HostSkipCaps(None).report(None).shape == (1, 0, 2)


def test_a_step_traced_by_the_caller_keeps_its_cap_in_the_program(mesh):
    # Inside the caller's own jit no step is done before the caller's program ends: the cap
    # stays in that program; jc.comms_report still inspects the step.
    step, state = jc.make_train_step(
        mesh, "dp", loss_fn, OPTIMIZERS["onebit_adam"](2), params(), check_skips_on_host=True
    )
    assert jc.comms_report(step, state, GOOD).ok
    traced = jax.jit(step)
    hlo = traced.lower(state, GOOD).compile().as_text()
    assert "conditional(" in hlo and re.search(r"custom_call_target=\"\w*python\w*callback", hlo)
    for batch in [GOOD] * 3:  # (the in-program check's raising: tests/optim)
        state, loss = traced(state, batch)
    assert np.isfinite(float(loss))
    step.check_skips()  # nothing was queued for the host
