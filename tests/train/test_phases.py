"""Phase-specialised train steps (jaxcomm.optim.schedule, jaxcomm.train.phased)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc
from jaxcomm.inspect.hlo import collectives_in_hlo
from jaxcomm.optim.schedule import fixed_phases, record_phases
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES
D = 24
STEPS = 12
LR = 1e-2


def regression(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4 * N, D)).astype(np.float32)
    y = (x @ rng.normal(size=(D,)) + 0.3).astype(np.float32)
    return {"w": np.zeros((D,), np.float32), "b": np.zeros((), np.float32)}, (x, y)


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def batch_on(mesh, batch):
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    return jax.device_put(batch, split)


# Exact compressors: no 1-bit sign can flip on a last-bit difference, so the two programs'
# trajectories differ by fp32 rounding only (XLA contracts multiply-adds differently in them).
SCHEDULES = {
    "onebit_adam": (
        lambda c: jc.onebit_adam(LR, freeze_step=4, axis_name="dp", compressor=c),
        {(0,), (1,), (2,)},  # warm-up, first compressed step (into the step's space), after
    ),
    "zero_one_adam": (
        lambda c: jc.zero_one_adam(
            LR,
            var_freeze_step=4,
            local_step_scaler=1,
            local_step_clipper=4,
            axis_name="dp",
            compressor=c,
        ),
        {(0,), (2,), (3,), (4,)},  # (4,): the first sync after the freeze
    ),
    "onebit_lamb": (
        lambda c: jc.onebit_lamb(LR, freeze_step=4, axis_name="dp", compressor=c),
        {(0,), (1,)},
    ),
    "compressed_mean": (
        lambda c: optax.chain(jc.compressed_mean("dp", c, warmup_steps=3), optax.adam(LR)),
        {(0,), (1,)},
    ),
    "diloco": (
        lambda c: jc.diloco(optax.adam(LR), optax.sgd(0.7, momentum=0.9), 4, "dp", compressor=c),
        {(0, 0), (1, 1)},
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_specialised_step_follows_the_single_program(mesh, name):
    make, phases = SCHEDULES[name]
    params, batch = regression()
    batch = batch_on(mesh, batch)
    one, s1 = jc.make_train_step(
        mesh, "dp", loss_fn, make(jc.NoCompression()), params, specialize_phases=False
    )
    phased, s2 = jc.make_train_step(mesh, "dp", loss_fn, make(jc.NoCompression()), params)
    seen = set()
    for _ in range(STEPS):
        s1, l1 = one(s1, batch)
        s2, l2 = phased(s2, batch)
        seen.add(phased.last_phases)
        # The two programs contract multiply-adds differently: up to 8 fp32 ulps per value per
        # step, accumulated over the steps; x10 for the loss, a mean of squared residuals over
        # 24 features whose relative error grows where a residual is small.
        np.testing.assert_allclose(l2, l1, rtol=STEPS * 8 * 2**-24 * 10)
    assert seen == phases
    # Compiled on the first call: the combinations the schedule reaches (every value of 0/1
    # Adam's kind, whose probe reads its intervals: a superset).
    assert set(phased.compiled_phases) >= phases
    # States: the same 8 ulps x 12 steps (5.7e-6, rounded up to 1e-5); atol for entries near
    # 0 (moments and updates of size lr * ulp).
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_pmap_step_specialises_phases_as_the_shard_map_one(mesh, name):
    # Replicated (1-bit Adam) and per-device (0/1 Adam) state; the same programs per phase.
    make, phases = SCHEDULES[name]
    params, batch = regression()
    tx = make(jc.NoCompression())
    sharded, s1 = jc.make_train_step(mesh, "dp", loss_fn, tx, params, specialize_phases=True)
    pmapped, s2 = jc.make_pmap_train_step(
        "dp", loss_fn, tx, params, devices=jax.devices()[:N], specialize_phases=True
    )
    on_mesh = batch_on(mesh, batch)
    for _ in range(STEPS):
        s1, l1 = sharded(s1, on_mesh)
        s2, l2 = pmapped(s2, batch)
        np.testing.assert_allclose(l2, l1, rtol=STEPS * 8 * 2**-24 * 10)
    assert set(pmapped.phased.compiled_phases) == phases
    assert pmapped.phased.last_phases == sharded.last_phases
    got = jc.from_pmap_layout(s2)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def _passes_through(hlo: str, computation: str) -> bool:
    """Whether ``computation`` (a conditional's branch) returns its parameter unchanged."""
    body = hlo[hlo.index(f"\n%{computation} (") :].split("\n}", 1)[0]
    return any(" ROOT " in f" {line}" and " parameter(0)" in line for line in body.splitlines())


def _state_branches(hlo: str, num_scales: int) -> list[str]:
    """The ENTRY's conditionals that take a float array of more than ``num_scales`` elements and
    do not just pass it through.

    The schedule's branches take the state (moments, error feedback), and XLA copies a state
    that passes through one. OneBit's guarded decoding is a conditional too: it takes the
    packed signs (u8) and the ``n`` scales and, where the mean is the new momentum (1-bit Adam
    in the step's space), the old momentum, which its other branch returns as it is.
    """
    entry = hlo[hlo.index("ENTRY") :]
    types = {}
    for line in entry.splitlines():
        if " = " in line:
            name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
            types[name] = rest.split(" ", 1)[0] if not rest.startswith("(") else rest
    branches = []
    for line in entry.splitlines():
        if " conditional(" not in line:
            continue
        names = line.split("branch_computations={", 1)[1].split("}", 1)[0]
        if any(_passes_through(hlo, name.strip().lstrip("%")) for name in names.split(",")):
            continue
        operands = line.split(" conditional(", 1)[1].split(")", 1)[0].split(", ")[1:]
        for operand in operands:
            for dims in types.get(operand.strip(), "").split("f32[")[1:]:
                size = np.prod([int(d) for d in dims.split("]")[0].split(",") if d])
                if size > num_scales:
                    branches.append(line.strip()[:120])
    return branches


def _state_copies(hlo: str, num_scales: int) -> list[str]:
    """Copies of float arrays of more than ``num_scales`` elements in the compiled program."""
    found = []
    for line in hlo.splitlines():
        if " copy(" in line and " = f32[" in line:
            dims = line.split(" = f32[", 1)[1].split("]", 1)[0]
            if np.prod([int(d) for d in dims.split(",") if d]) > num_scales:
                found.append(line.strip()[:120])
    return found


def test_onebit_programs_have_no_branch_and_the_probe_sends_nothing(mesh):
    params, batch = regression()
    batch = batch_on(mesh, batch)
    tx = jc.onebit_adam(LR, freeze_step=2, axis_name="dp")
    single, state = jc.make_train_step(
        mesh, "dp", loss_fn, tx, params, specialize_phases=False
    )
    n = mesh.devices.size
    assert _state_branches(single.lower(state, batch).compile().as_text(), n)
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params, specialize_phases=True)
    assert step.phases(state, batch) == (0,)
    for _ in range(4):
        state, _ = step(state, batch)
    assert step.phases(state, batch) == (2,) == step.last_phases
    assert len(step.compiled_phases) == 3
    for values in step.compiled_phases:
        hlo = step.program(values).lower(state, batch).compile().as_text()
        assert _state_branches(hlo, n) == []
        assert _state_copies(hlo, n) == []
        # Compressed, the mean is the new momentum: the guard's conditional decodes it into the
        # leaves, or passes the old momentum through (no select over it after).
        fallback = [
            line for line in hlo.splitlines() if "conditional(" in line and "f32[24]" in line
        ]
        assert bool(fallback) == (values[0] >= 1), fallback
        kinds = {c.op for c in collectives_in_hlo(hlo)}
        # warm-up: the exact fp32 mean; compressed: OneBit's packed signs, no fp32 all-reduce
        # of the parameters' size.
        assert ("all-to-all" in kinds) == (values[0] >= 1)
    probe = jax.jit(step.phased._probe).lower(state, batch).compile().as_text()
    assert collectives_in_hlo(probe) == []


def test_a_schedule_without_phases_compiles_one_program(mesh):
    params, batch = regression()
    batch = batch_on(mesh, batch)
    tx = optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.sgd(0.1))
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params, specialize_phases=True)
    for _ in range(3):
        state, _ = step(state, batch)
    assert step.compiled_phases == [()]


def test_phase_helpers_outside_a_specialised_step_are_lax_cond_and_switch():
    count = jnp.int32(3)
    pred = jc.phase(count < 2)
    assert isinstance(pred, jax.Array)  # traced/array value handed back unchanged

    def f(c):
        return jc.phase_cond(jc.phase(c < 2), lambda x: x + 1, lambda x: x - 1, jnp.float32(5))

    assert float(jax.jit(f)(count)) == 4.0 and float(jax.jit(f)(jnp.int32(0))) == 6.0
    branches = [lambda x: x * 0, lambda x: x * 10, lambda x: x * 100]
    g = jax.jit(lambda k: jc.phase_switch(jc.phase(k, 3), branches, jnp.float32(2)))
    assert [float(g(jnp.int32(k))) for k in range(3)] == [0.0, 20.0, 200.0]
    # Python values pick the branch without tracing the other one.
    assert jc.phase_cond(True, lambda: 1, lambda: 1 / 0) == 1
    assert jc.phase_switch(1, [lambda: 1 / 0, lambda: 7]) == 7


def test_fixed_phases_hand_out_python_values_in_order():
    with record_phases() as recorded:
        jc.phase(jnp.bool_(True))
        jc.phase(jnp.int32(2), 4)
    assert [int(v) for v in recorded.values] == [1, 2]
    with fixed_phases((1, 2)):
        assert jc.phase(jnp.bool_(False)) is True
        assert jc.phase(jnp.int32(0), 4) == 2
    with pytest.raises(RuntimeError, match="asked for 1 phases"):
        with fixed_phases((1, 2)):
            jc.phase(jnp.bool_(False))
    with pytest.raises(RuntimeError, match="more phases"), fixed_phases(()):
        jc.phase(jnp.bool_(False))
    with pytest.raises(ValueError, match="outside"), fixed_phases((5,)):
        jc.phase(jnp.int32(0), 4)


@pytest.mark.parametrize(
    "value, cases, err",
    [
        (jnp.zeros(3, bool), 2, TypeError),
        (jnp.float32(1.0), 2, TypeError),
        (jnp.int32(1), 0, ValueError),
    ],
)
def test_bad_phase_values_are_refused(value, cases, err):
    with pytest.raises(err, match="phase"):
        jc.phase(value, cases)


def _entry_copies(hlo: str, min_elements: int) -> list[str]:
    """The ENTRY computation's copy instructions of arrays with at least ``min_elements``."""
    entry = hlo[hlo.index("ENTRY") :]
    big = []
    for line in entry.splitlines():
        if " copy(" not in line:
            continue
        dims = line.split("=", 1)[1].split("[", 1)[1].split("]", 1)[0]
        if int(np.prod([int(d) for d in dims.split(",") if d])) >= min_elements:
            big.append(line.strip())
    return big


def test_onebit_adam_without_warm_up_compiles_no_schedule_branch(mesh):
    """freeze_step=0 (static): the single program has no conditional taking the state (the
    warm-up branch is not compiled in), before and after the moments move to the step's space."""
    params, batch = regression()
    batch = batch_on(mesh, batch)
    tx = jc.onebit_adam(LR, freeze_step=0, axis_name="dp")
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params, specialize_phases=False)
    for _ in range(2):
        assert _state_branches(step.lower(state, batch).compile().as_text(), N) == []
        state, _ = step(state, batch)
    assert bool(state.opt_state.preconditioned)


@pytest.mark.parametrize(
    "name, make, phases",
    [
        (
            "zero_one_adam local step",
            lambda: jc.zero_one_adam(
                LR, var_freeze_step=2, local_step_scaler=1, local_step_clipper=4, axis_name="dp"
            ),
            (2,),
        ),
        (
            "diloco inner step",
            lambda: jc.diloco(optax.adam(LR), optax.sgd(0.7, momentum=0.9), 4, "dp"),
            (0, 0),
        ),
        (
            "onebit_adam compressed step",
            lambda: jc.onebit_adam(LR, freeze_step=2, axis_name="dp"),
            (2,),
        ),
    ],
)
def test_specialised_steps_copy_no_state(mesh, name, make, phases):
    # XLA:CPU copies a donated buffer that one fusion writes in place while another reads it
    # unordered, or that passes through a reshape: these steps are written to avoid both (0/1
    # Adam's local moments and DiLoCo's inner state stay blocks, 0/1 Adam writes m before the
    # step reads it, DiLoCo's inner update does not read p).
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(64, 48)).astype(np.float32), "b": np.zeros(48, np.float32)}

    def loss(p, batch):
        return jnp.mean((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2)

    x = rng.normal(size=(4 * N, 64)).astype(np.float32)
    batch = batch_on(mesh, (x, rng.normal(size=(4 * N, 48)).astype(np.float32)))
    step, state = jc.make_train_step(mesh, "dp", loss, make(), params, specialize_phases=True)
    for _ in range(20):
        if step.phases(state, batch) == phases:
            break
        state, _ = step(state, batch)
    assert step.phases(state, batch) == phases, name
    hlo = step.program(phases).lower(state, batch).compile().as_text()
    assert _entry_copies(hlo, 64 * 48) == []
