"""jc.scale_by_demo, DeMo's direction sign(U), and jc.demo: the alias is the direction then
``optax.scale_by_learning_rate``, bit for bit, on 8 devices of a shard_map."""

import numpy as np
import optax
import pytest

import jaxcomm as jc
from tests.conftest import NUM_DEVICES
from tests.optim.shard_map_run import assert_bitwise_equal, run_updates

N = NUM_DEVICES
SHAPES = {"w": (16, 24), "b": (24,), "v": (5,)}
KW = dict(axis_name="dp", top_k=4, chunk_size=8)
STEPS = 5


def init_params():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def grad_steps(seed=1):
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(STEPS)
    ]


def assert_same_runs(alias, chain):
    steps = grad_steps()
    want = run_updates(alias, init_params(), steps)
    got = run_updates(chain, init_params(), steps)
    for t, ((u_a, p_a, s_a), (u_c, p_c, s_c)) in enumerate(zip(want, got, strict=True)):
        assert isinstance(s_c[0], jc.DemoState)
        assert_bitwise_equal((u_c, p_c, s_c[0]), (u_a, p_a, s_a), f"step {t}")
    assert int(s_a.count) == STEPS
    assert not np.array_equal(p_a["w"], init_params()["w"])
    # The momentum is each device's own: the devices' differ.
    assert not np.array_equal(s_a.local.mu["w"][0], s_a.local.mu["w"][1])


def test_demo_is_scale_by_demo_then_the_learning_rate():
    """Any learning rate (a schedule here): ``-(lr sign(U))`` and ``(-lr) sign(U)`` are the same
    bits. The rate also weighs the gradients in the momentum, so the direction takes it too."""
    lr = optax.linear_schedule(0.05, 0.01, STEPS)
    chain = optax.chain(jc.scale_by_demo(lr, **KW), optax.scale_by_learning_rate(lr))
    assert_same_runs(jc.demo(lr, **KW), chain)


@pytest.mark.parametrize("lr", [2.0**-5, 0.03], ids=["power_of_two", "other"])
def test_demo_with_weight_decay_against_optax_pieces(lr):
    """With weight decay DeMo's update is ``-(lr sign(U) + (wd lr) p)``, the reference's order;
    ``add_decayed_weights`` then ``scale_by_learning_rate`` computes ``-lr (sign(U) + wd p)``:
    the same bits for a power-of-two rate, one rounding apart otherwise."""
    wd = 0.1
    alias = jc.demo(lr, weight_decay=wd, **KW)
    chain = optax.chain(
        jc.scale_by_demo(lr, **KW), optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr)
    )
    if lr == 2.0**-5:
        assert_same_runs(alias, chain)
        return
    steps = grad_steps()[:1]
    ((u_a, _, s_a),) = run_updates(alias, init_params(), steps)
    ((u_c, _, s_c),) = run_updates(chain, init_params(), steps)
    assert_bitwise_equal(s_c[0], s_a)
    for k in SHAPES:
        np.testing.assert_allclose(u_c[k], u_a[k], rtol=1e-6, atol=0)
