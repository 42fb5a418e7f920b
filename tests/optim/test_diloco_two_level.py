"""jc.diloco over a tuple of mesh axes, slowest first: a replica is a node (a slow-axis group).

A 2 x 4 mesh of the simulated CPU devices stands in for 2 nodes of 4 devices. Inner steps are
plain data parallel inside a node (the exact mean of its 4 devices' gradients, nothing across
``host``); every ``H`` steps the outer sync runs compressed across ``host``. The reference is a
NumPy model (float64) of 2 replicas, each stepping on its node's whole batch, written from the
papers (DiLoCo, arXiv:2311.08105; Streaming DiLoCo, arXiv:2501.18512), not from jaxcomm's code.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomm as jc
from jaxcomm.inspect import wire_bytes_by_axes

S, L = 2, 4
AXES = ("host", "local")
IN, OUT = 5, 3
B = 2  # examples per device
HYPER = dict(inner_lr=0.05, inner_mom=0.9, outer_lr=0.7, outer_mom=0.9)


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((S, L), AXES, axis_types=(AxisType.Auto,) * 2)


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def numpy_grads(leaves, x, y):
    """Gradients of ``loss_fn`` for leaves ``[b, w]`` (tree order), float64."""
    b, w = leaves
    err = x @ w + b - y
    scale = 2.0 / err.size
    return [scale * err.sum(axis=0), scale * x.T @ err]


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(IN, OUT)).astype(np.float32),
        "b": rng.normal(size=(OUT,)).astype(np.float32) * 0.1,
    }


def make_batches(count, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(S * L * B, IN)).astype(np.float32),
            rng.normal(size=(S * L * B, OUT)).astype(np.float32),
        )
        for _ in range(count)
    ]


def numpy_nodes(params, batches, *, H, F, tau, alpha, nesterov, skip=(), **hyper):
    """Streaming DiLoCo of ``S`` replicas, replica ``s`` stepping (SGD with momentum) on the
    rows of its node's ``L`` devices; fragment ``f`` records ``mean_s(theta_f - x_s,f)`` after
    the steps ``t % H == o_f`` and applies the outer SGD ``tau`` steps later. ``(t, s)`` in
    ``skip``: node ``s`` does not step at step ``t``."""
    theta = [np.asarray(params[k], np.float64) for k in ("b", "w")]
    xs = [[p.copy() for p in theta] for _ in range(S)]
    inner_m = [[np.zeros_like(p) for p in theta] for _ in range(S)]
    outer_m = [np.zeros_like(p) for p in theta]
    offsets = [((f + 1) * H // F) % H for f in range(F)]
    pending = {}
    rows = L * B
    for t, (x, y) in enumerate(batches, start=1):
        for s in range(S):
            if (t, s) in skip:
                continue
            grads = numpy_grads(xs[s], x[s * rows : (s + 1) * rows], y[s * rows : (s + 1) * rows])
            for i, g in enumerate(grads):
                inner_m[s][i] = g + hyper["inner_mom"] * inner_m[s][i]
                xs[s][i] = xs[s][i] - hyper["inner_lr"] * inner_m[s][i]
        for f in range(F):
            ids = range(f, len(theta), F)
            if t % H == offsets[f]:
                pending[f] = {i: np.mean([theta[i] - xs[s][i] for s in range(S)], 0) for i in ids}
            if t - tau >= 1 and (t - tau) % H == offsets[f]:
                for i in ids:
                    delta = pending[f][i]
                    outer_m[i] = delta + hyper["outer_mom"] * outer_m[i]
                    step = delta + hyper["outer_mom"] * outer_m[i] if nesterov else outer_m[i]
                    theta[i] = theta[i] - hyper["outer_lr"] * step
                    for s in range(S):
                        xs[s][i] = alpha * xs[s][i] + (1 - alpha) * theta[i]
    return theta, xs


def make_tx(H, *, nesterov=True, outer_lr=None, outer_mom=None, **kw):
    lr = HYPER["outer_lr"] if outer_lr is None else outer_lr
    mom = HYPER["outer_mom"] if outer_mom is None else outer_mom
    outer = optax.sgd(lr, momentum=mom or None, nesterov=nesterov)
    return jc.diloco(
        optax.sgd(HYPER["inner_lr"], momentum=HYPER["inner_mom"]), outer, H, AXES, **kw
    )


def run(mesh, tx, params, batches, each=None):
    return run_from(*jc.make_train_step(mesh, AXES, loss_fn, tx, params), batches, each)


def run_from(step, initial, batches, each=None):
    """``step`` over ``batches`` from a copy of ``initial`` (kept: the step donates its input)."""
    state = jax.tree.map(jnp.copy, initial)
    losses = []
    for batch in batches:
        state, loss = step(state, batch)
        losses.append(float(loss))
        if each is not None:
            each(state)
    return state, losses


@functools.cache
def _shared_step(mesh, H, tx_kw):
    return jc.make_train_step(mesh, AXES, loss_fn, make_tx(H, **dict(tx_kw)), make_params())


def run_shared(mesh, H, batches, each=None, **tx_kw):
    """``run(mesh, make_tx(H, **tx_kw), make_params(), batches, each)`` on a train step compiled
    once per configuration (jc.diloco's defaults filled in: the exact ``make_tx(3)`` of several
    tests is the plain-nesterov case too), shared by the tests that run it."""
    tx_kw = dict(fragments=1, overlap_steps=0, alpha=0.0) | tx_kw
    return run_from(*_shared_step(mesh, H, tuple(sorted(tx_kw.items()))), batches, each)


def same_within_nodes(state):
    """Every per-device parameter is bit-identical across ``local`` within each host."""
    for leaf in jax.tree.leaves(state.params):
        leaf = np.asarray(leaf)
        assert leaf.shape[0] == S * L  # per device, rank-major (host, local)
        for s in range(S):
            for i in range(1, L):
                np.testing.assert_array_equal(leaf[s * L + i], leaf[s * L])


@pytest.mark.parametrize(
    "H, F, tau, alpha, outer",
    [
        (3, 1, 0, 0.0, "sgd1"),
        (3, 1, 0, 0.0, "nesterov"),
        (4, 2, 0, 0.0, "nesterov"),
        (4, 2, 1, 0.5, "nesterov"),
    ],
    ids=["plain-sgd1", "plain-nesterov", "F2", "F2-tau1-alpha0.5"],
)
def test_exact_diloco_over_the_tuple_equals_numpy_nodes(mesh2d, H, F, tau, alpha, outer):
    """NoCompression outer: 2 replicas, each exact data parallel over its node's 4 devices."""
    params, batches = make_params(), make_batches(13)
    extra = dict(outer_lr=1.0, outer_mom=0.0, nesterov=False) if outer == "sgd1" else {}
    state, _ = run_shared(
        mesh2d, H, batches, same_within_nodes, compressor=jc.NoCompression(), fragments=F,
        overlap_steps=tau, alpha=alpha, **extra,
    )  # fmt: skip
    hyper = dict(HYPER, outer_lr=1.0, outer_mom=0.0) if outer == "sgd1" else HYPER
    theta, xs = numpy_nodes(
        params, batches, H=H, F=F, tau=tau, alpha=alpha, nesterov=outer != "sgd1", **hyper
    )
    got_theta = jax.tree.leaves(jc.diloco_params(state.opt_state))
    for got, want in zip(got_theta, theta, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    for i, leaf in enumerate(jax.tree.leaves(state.params)):
        for s in range(S):
            np.testing.assert_allclose(np.asarray(leaf)[s * L], xs[s][i], rtol=2e-5, atol=2e-6)
    # 13 steps after the last sync: the two nodes' copies have moved apart.
    assert not np.allclose(xs[0][1], xs[1][1])


def test_a_nonfinite_gradient_on_one_device_skips_its_node(mesh2d):
    """A NaN in one example of device (0, 2) at step 2: node 0 skips that inner step (its 4
    devices alike, their copies stay identical), node 1 steps on."""
    params, batches = make_params(), make_batches(7)
    batches[1][0][2 * B, 0] = np.nan  # device (host 0, local 2), step 2
    state, _ = run_shared(mesh2d, 3, batches, same_within_nodes, compressor=jc.NoCompression())
    theta, xs = numpy_nodes(
        params, batches, H=3, F=1, tau=0, alpha=0.0, nesterov=True, skip={(2, 0)}, **HYPER
    )
    for got, want in zip(jax.tree.leaves(jc.diloco_params(state.opt_state)), theta, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    for i, leaf in enumerate(jax.tree.leaves(state.params)):
        for s in range(S):
            np.testing.assert_allclose(np.asarray(leaf)[s * L], xs[s][i], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(state.opt_state.local.skips.total), [1] * L + [0] * L)
    assert int(state.opt_state.skips.total) == 0


def test_the_replicas_are_nodes_not_devices(mesh2d):
    """The same run over one flat axis of the 8 devices (8 replicas) is another trajectory."""
    params, batches = make_params(), make_batches(6)
    state, _ = run_shared(mesh2d, 3, batches, compressor=jc.NoCompression())
    got = np.asarray(jc.diloco_params(state.opt_state)["w"])
    flat_mesh = jax.make_mesh((S * L,), ("dp",), axis_types=(AxisType.Auto,))
    tx = jc.diloco(
        optax.sgd(HYPER["inner_lr"], momentum=HYPER["inner_mom"]),
        optax.sgd(HYPER["outer_lr"], momentum=HYPER["outer_mom"], nesterov=True),
        3,
        "dp",
    )
    step, flat = jc.make_train_step(flat_mesh, "dp", loss_fn, tx, params)
    for batch in batches:
        flat, _ = step(flat, batch)
    assert not np.allclose(np.asarray(jc.diloco_params(flat.opt_state)["w"]), got, atol=1e-4)


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(64, 128)).astype(np.float32) / 8,
        "b": np.zeros((128,), np.float32),
    }


def mlp_loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)


def mlp_batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(64, 128)).astype(np.float32) / 8
    out = []
    for _ in range(steps):
        x = rng.normal(size=(S * L * 4, 64)).astype(np.float32)
        out.append((x, np.tanh(x @ teacher)))
    return out


@functools.cache
def mlp_step(mesh, comp):
    """The MLP's DiLoCo step (Adam inner, Nesterov outer, H=4) with ``comp`` across ``host``,
    compiled once for both tests of that compressor: its bytes and its learning."""
    tx = jc.diloco(
        optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True), 4, AXES, compressor=comp
    )
    return jc.make_train_step(mesh, AXES, mlp_loss, tx, mlp_params())


def host_bytes(step, state, batch, mesh):
    text = step.lower(state, batch).compile().as_text()
    return sum(v for k, v in wire_bytes_by_axes(text, mesh).items() if "host" in k)


# (compressor, bits per element of what crosses the slow axis)
COMPRESSORS = [
    ("exact", jc.NoCompression(), 32),
    ("int8", jc.Quantize(bits=8, error_feedback=True), 8),
    ("int4", jc.Quantize(bits=4, error_feedback=True), 4),
    ("onebit", jc.OneBit(), 1),
    ("sparseloco", jc.SparseLoCo(), None),
]


@pytest.mark.parametrize("name,comp,bits", COMPRESSORS, ids=[c[0] for c in COMPRESSORS])
def test_only_the_sync_crosses_nodes_and_only_its_share(mesh2d, name, comp, bits):
    """The compiled inner step sends nothing across ``host`` but the reported loss's mean (one
    fp32 scalar); the sync step sends the
    compressed ``1/L`` share: <= 1.3 x (2 P bits / 8) / L + a few kB."""
    H = 4
    params, data = mlp_params(), mlp_batches(H + 1)
    step, initial = mlp_step(mesh2d, comp)
    state = jax.tree.map(jnp.copy, initial)  # the step donates its input
    # The reported loss is the mean over all devices: one fp32 scalar all-reduced over the 8
    # (a ring sends 2 x 7/8 x 4 = 7 bytes per device), the only thing an inner step sends.
    loss_only = 2 * (S * L - 1) / (S * L) * 4
    by_phases = {}  # a step runs the program of its state's phases: one compile per program
    for t in range(1, H + 1):  # the state before step t: steps 1 .. H - 1 inner, H the sync
        phases = step.phases(state, data[t - 1])
        if phases not in by_phases:
            by_phases[phases] = host_bytes(step, state, data[t - 1], mesh2d)
        across = by_phases[phases]
        if t < H:
            assert across == loss_only, (t, across)
        else:
            synced = across
        state, _ = step(state, data[t - 1])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    if bits is None:  # SparseLoCo: its gathered parts, bounded by the exact share
        assert synced < (2 * n_params * 4) / L / 4, synced
    else:
        assert synced <= 1.3 * (2 * n_params * bits / 8) / L + 4096, (name, synced)
    assert synced > loss_only  # the sync does cross


LEARNERS = [c[:2] for c in COMPRESSORS] + [
    ("topk", jc.TopK(0.1)),
    ("cast-bf16", jc.Cast(jnp.bfloat16)),
]


@pytest.mark.parametrize("name,comp", LEARNERS, ids=[c[0] for c in LEARNERS])
def test_compressed_outer_learns_and_nodes_stay_identical(mesh2d, name, comp):
    data = mlp_batches(24, seed=3)
    step, initial = mlp_step(mesh2d, comp)
    state = jax.tree.map(jnp.copy, initial)  # the step donates its input
    losses = []
    for batch in data:
        state, loss = step(state, batch)
        losses.append(float(loss))
        same_within_nodes(state)
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < 0.7 * losses[0], (name, losses)
    theta = jc.diloco_params(state.opt_state)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(theta))


def test_streaming_fragments_with_sparseloco(mesh2d):
    """Streaming DiLoCo (2 fragments, overlap 1) with SparseLoCo across ``host`` learns; more
    slowly than with the exact outer mean (it sends a few percent of the outer gradient and
    carries the rest in its error feedback), but not far behind."""
    data = mlp_batches(24, seed=4)
    curves = {}
    for name, comp in (("exact", jc.NoCompression()), ("sparseloco", jc.SparseLoCo())):
        tx = jc.diloco(
            optax.adam(1e-2), optax.sgd(0.7), 4, AXES, comp, fragments=2, overlap_steps=1
        )
        step, state = jc.make_train_step(mesh2d, AXES, mlp_loss, tx, mlp_params())
        losses = []
        for batch in data:
            state, loss = step(state, batch)
            losses.append(float(loss))
            same_within_nodes(state)
        curves[name] = losses
    sparse, exact = curves["sparseloco"], curves["exact"]
    assert np.mean(sparse[-4:]) < 0.9 * sparse[0], sparse
    assert np.mean(sparse[-4:]) <= 1.4 * np.mean(exact[-4:]), curves


def test_init_outside_the_mesh_needs_the_sizes():
    tx = make_tx(3, compressor=jc.Quantize(bits=4, error_feedback=True), axis_size=(S, L))
    state = tx.init(make_params())
    assert state.devices.shape == (S * L,)
    with pytest.raises(ValueError, match="not bound"):
        make_tx(3).init(make_params())
    with pytest.raises(ValueError, match="tuple of their sizes"):
        make_tx(3, axis_size=8).init(make_params())


def test_refused_over_the_tuple():
    # background=True runs over the tuple (tests/optim/test_diloco_background_two_level.py).
    assert make_tx(6, overlap_steps=2, background=True).update.spec.axis_name == AXES
    with pytest.raises(ValueError, match="1-D shares"):
        make_tx(3, compressor=jc.PowerSGD())


def test_one_axis_in_a_tuple_is_that_axis():
    mesh = jax.make_mesh((S * L,), ("dp",), axis_types=(AxisType.Auto,))
    params, batches = make_params(), make_batches(5)
    states = []
    for axis in ("dp", ("dp",)):
        tx = jc.diloco(
            optax.sgd(0.05), optax.sgd(0.7), 2, axis, jc.Quantize(bits=4, error_feedback=True)
        )
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
        for batch in batches:
            state, _ = step(state, batch)
        states.append(state)
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
