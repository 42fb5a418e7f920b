"""PowerSGD's compiled step: its guard decides from the all-reduced factors, so the error
feedback is written once, in its donated buffer (no copy, no separate select pass)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc

N = 8
ROWS, COLS = 64, 256


def _compiled(comp):
    mesh = jax.make_mesh((N,), ("dp",))
    split = NamedSharding(mesh, P("dp"))
    like = {"w": jnp.zeros((ROWS, COLS))}
    state = jax.device_put(jc.stack_per_device(jc.init_state(comp, like, axis_size=N), N), split)
    grads = jax.device_put({"w": jnp.ones((N * ROWS, COLS))}, split)

    def body(g, s):
        return jc.compressed_pmean(g, s, axis_name="dp", compressor=comp)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp"))),
        donate_argnums=1,
    )
    return fn, grads, state


def test_error_feedback_is_written_in_place_without_a_copy():
    fn, grads, state = _compiled(jc.PowerSGD(rank=2))
    text = fn.lower(grads, state).compile().as_text()
    entry = text[text.index("ENTRY") :]
    numel = ROWS * COLS
    copies = [
        line
        for line in entry.splitlines()
        if re.search(rf"f32\[(1,)?{numel}\]\S* copy\(", line)
    ]
    assert copies == []
    assert re.search(r"input_output_alias=\{[^}]*\{1\}: \(1,", text)  # error donated in place


def test_a_finite_step_advances_and_a_nan_keeps_the_state():
    """Against the invariant: with a NaN on one device nothing of the state moves and the
    call is counted; a finite call moves the step and leaves a finite residual."""
    fn, grads, state = _compiled(jc.PowerSGD(rank=2))
    mean, state = fn(grads, state)
    assert np.isfinite(np.asarray(mean["w"])).all()
    before = jax.tree.map(np.asarray, state)
    assert (before.buckets[0].step == 1).all()
    bad = np.ones((N * ROWS, COLS), np.float32)
    bad[3 * ROWS + 5, 7] = np.nan  # on device 3
    mean, state = fn({"w": jax.device_put(bad, grads["w"].sharding)}, state)
    after = jax.tree.map(np.asarray, state)
    assert not np.isfinite(np.asarray(mean["w"])).all()
    np.testing.assert_array_equal(after.buckets[0].error, before.buckets[0].error)
    np.testing.assert_array_equal(after.buckets[0].q, before.buckets[0].q)
    np.testing.assert_array_equal(after.buckets[0].step, before.buckets[0].step)
    assert (after.nonfinite == before.nonfinite + 1).all()
