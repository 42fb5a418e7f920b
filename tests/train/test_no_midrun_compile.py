"""No compile after the first step: a phase-specialised step compiles every program its
schedule reaches on its first call (or in ``step.compile_all`` before it), the same programs
the on-demand step compiles when it first meets each phase."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES
D = 16
LR = 1e-2
# JAX's event for each XLA compile (jax/_src/dispatch.py BACKEND_COMPILE_EVENT).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """Counts XLA compiles while open (``events[0]``)."""
    events = [0]

    def listen(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            events[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def problem(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2 * N, D)).astype(np.float32)
    y = (x @ rng.normal(size=(D,)) + 0.3).astype(np.float32)
    params = {"w": np.zeros((D,), np.float32), "b": np.zeros((), np.float32)}
    return params, (x, y)


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# name: (optimizer, steps run, the phase combinations the run meets (hand-derived), exact:
# whether compile_all follows the schedule (else it compiles every combination of values)).
SCHEDULES = {
    # Warm-up (kind 0) for 3 steps, the first compressed step (1), then compressed (2).
    "onebit_adam": (lambda: jc.onebit_adam(LR, freeze_step=3, axis_name="dp"), 7, 3, False),
    # count < freeze_step: True for 3 steps, then False.
    "onebit_lamb": (lambda: jc.onebit_lamb(LR, freeze_step=3, axis_name="dp"), 7, 2, True),
    # total_steps=120: variance refreshes every step, then every 2nd (kind 1 at step 17),
    # frozen after 18: the first sync (4) at step 19, then syncs (3) and local steps (2).
    "zero_one_adam": (lambda: jc.zero_one_adam(LR, axis_name="dp", total_steps=120), 28, 5, False),
    # (synced, skip check): inner steps (0, 0), syncs at steps 3 and 6 (1, 1).
    "diloco": (lambda: jc.diloco(optax.adam(LR), optax.sgd(0.7), 3, "dp"), 8, 2, True),
    # Streaming: two fragments, each merged a step after it syncs.
    "diloco_streaming": (
        lambda: jc.diloco(optax.adam(LR), optax.sgd(0.7), 4, "dp", fragments=2, overlap_steps=1),
        10,
        3,
        True,
    ),
    "compressed_mean": (
        lambda: optax.chain(jc.compressed_mean("dp", jc.OneBit(), warmup_steps=3), optax.adam(LR)),
        6,
        2,
        True,
    ),
}


def run(step, state, batch, steps):
    """The run's final state, the phases of each step and the XLA compiles after step 1."""
    seen = []
    state, _ = step(state, batch)
    seen.append(step.last_phases)
    count = step.compile_count
    with backend_compiles() as compiles:
        for _ in range(steps - 1):
            state, _ = step(state, batch)
            seen.append(step.last_phases)
        jax.block_until_ready(state)
    return state, seen, compiles[0], step.compile_count - count


def assert_same_bits(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_no_compile_after_the_first_step(mesh, name):
    make, steps, reached, exact = SCHEDULES[name]
    params, batch = problem()
    step, state = jc.make_train_step(mesh, "dp", loss_fn, make(), params)
    lazy, lazy_state = jc.make_train_step(mesh, "dp", loss_fn, make(), params, precompile=False)
    state, seen, compiles, counted = run(step, state, batch, steps)
    lazy_state, lazy_seen, lazy_compiles, lazy_counted = run(lazy, lazy_state, batch, steps)

    assert (compiles, counted) == (0, 0)
    # The on-demand step meets its later phases mid-run and compiles there: the run covers
    # the whole schedule, and the listener sees compiles.
    assert len(set(seen)) == reached
    assert lazy_compiles >= reached - 1 and lazy_counted == reached - 1
    assert seen == lazy_seen
    # Same programs: the same state, bit for bit.
    assert_same_bits(state, lazy_state)
    if exact:  # the schedule followed: only the combinations the run meets
        assert set(step.compiled_phases) == set(seen)
    else:  # every combination of the phase's values (all reached here)
        assert set(step.compiled_phases) >= set(seen)
    assert len(step.compiled_phases) == len(step.phased._programs)


def test_compile_all_before_the_first_batch(mesh):
    params, (x, y) = problem()
    tx = jc.onebit_lamb(LR, freeze_step=2, axis_name="dp")
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, y))
    assert step.compile_all(state, shapes) == [(1,), (0,)]  # warm-up, then compressed
    assert step.compile_count == 4  # the probe, the schedule's follower, two programs
    with backend_compiles() as compiles:
        for _ in range(4):
            state, _ = step(state, (x, y))
        jax.block_until_ready(state)
    assert compiles[0] == 0 and step.compile_count == 4
    assert step.compile_all(state, shapes) == [(0,)]  # from here on: compressed only
    assert step.compile_count == 5  # a new follower, no program


def test_steps_bounds_the_followed_schedule(mesh):
    params, batch = problem()
    tx = optax.chain(jc.compressed_mean("dp", jc.OneBit(), warmup_steps=100), optax.sgd(LR))
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    assert step.phased.reachable_phases(state, step._place(batch), steps=100) == [(1,)]
    assert step.phased.reachable_phases(state, step._place(batch), steps=101) == [(1,), (0,)]
    assert step.compile_all(state, batch) == [(1,), (0,)]


def background_diloco():
    return jc.diloco(optax.adam(LR), optax.sgd(0.7), 3, "dp", overlap_steps=2, background=True)


def test_background_diloco_compiles_every_program_on_the_first_call(mesh):
    # Syncs issued before steps 4 and 7, merged at 5 and 8: the sync's own programs (issue,
    # server, finish; worker for a resumed sync) run on the sync thread, where the listener
    # sees their compiles too.
    params, batch = problem()
    step, state = jc.make_train_step(mesh, "dp", loss_fn, background_diloco(), params)
    lazy, lazy_state = jc.make_train_step(
        mesh, "dp", loss_fn, background_diloco(), params, precompile=False
    )
    state, seen, compiles, counted = run(step, state, batch, 8)
    lazy_state, lazy_seen, lazy_compiles, lazy_counted = run(lazy, lazy_state, batch, 8)
    assert (compiles, counted) == (0, 0)
    # The on-demand step compiles two phase programs and the sync's three mid-run.
    assert lazy_counted == 2 and lazy_compiles >= 5 and seen == lazy_seen
    assert set(step.compiled_phases) == set(seen) and len(set(seen)) == 3
    assert_same_bits(state, lazy_state)


def test_background_diloco_compile_all_before_the_first_batch(mesh):
    params, (x, y) = problem()
    step, state = jc.make_train_step(mesh, "dp", loss_fn, background_diloco(), params)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, y))
    step.compile_all(state, shapes)
    with backend_compiles() as compiles:
        for _ in range(8):
            state, _ = step(state, (x, y))
        jax.block_until_ready(state)
    assert compiles[0] == 0


def test_pmap_step_compiles_on_demand():
    # jax.pmap's ahead-of-time compiles do not reach its calls: its programs compile when met.
    params, batch = problem()
    step, state = jc.make_pmap_train_step("dp", loss_fn, SCHEDULES["onebit_lamb"][0](), params)
    assert not step.phased.precompile
    with pytest.raises(TypeError, match="make_train_step's steps"):
        step.compile_all(state, batch)


def test_compile_all_refuses_bad_input(mesh):
    params, (x, y) = problem()
    step, state = jc.make_train_step(
        mesh, "dp", loss_fn, jc.onebit_lamb(LR, freeze_step=2, axis_name="dp"), params
    )
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, y))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        step.compile_all(state, shapes, steps=0)
    with pytest.raises(TypeError, match="steps is an int"):
        step.compile_all(state, shapes, steps=2.5)
    with pytest.raises(TypeError, match="not both"):
        step.compile_all(state, (x, shapes[1]))
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    with pytest.raises(TypeError, match="the state itself"):
        step.compile_all(abstract, shapes)
    with pytest.raises(TypeError, match="precompile is a bool"):
        jc.make_train_step(mesh, "dp", loss_fn, optax.sgd(LR), params, precompile=1)


@pytest.mark.parametrize(
    "compressor", [None, jc.Quantize(bits=4, error_feedback=True)], ids=["exact", "int4-ef"]
)
def test_background_diloco_over_a_tuple_compiles_every_program_on_the_first_call(compressor):
    # 2 "hosts" of 4 devices: the sync's programs reduce-scatter over "local" and take the
    # wires gathered across "host" split over "local"; compiled before step 1 like the rest.
    axes = ("host", "local")
    mesh = jax.make_mesh((2, N // 2), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = jc.diloco(
        optax.adam(LR), optax.sgd(0.7), 3, axes, compressor, overlap_steps=2, background=True
    )
    params, batch = problem()
    step, state = jc.make_train_step(mesh, axes, loss_fn, tx, params)
    state, seen, compiles, counted = run(step, state, batch, 8)
    assert (compiles, counted) == (0, 0) and len(set(seen)) == 3
