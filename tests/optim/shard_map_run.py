"""A transformation's ``update`` on every device of a ``jax.shard_map``, the updates applied on
the host, for bit-for-bit comparisons of two transformations (an alias and its optax pieces).

The updates leave the program and NumPy adds them to the parameters: inside a train step XLA
may fuse the last multiply of the update with that addition into one fused multiply-add, which
rounds once where the two separate operations round twice, so the parameters of two programs
that compute the same updates could still differ by a rounding.
"""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from tests.conftest import NUM_DEVICES, make_mesh


def run_updates(tx, params, steps, *, per_device_params=False):
    """``[(updates, params, state)]`` after each of ``steps`` (gradients stacked ``(N, ...)``),
    as NumPy trees: ``state`` in the global layout, ``updates`` and ``params`` stacked ``(N,
    ...)`` when ``per_device_params`` (0/1 Adam), else replicated."""
    n = NUM_DEVICES
    state = jc.stack_per_device(tx.init(params), n)  # axis size: jax.device_count() == N
    specs = jc.state_partition_specs(state, "dp")
    p_spec = P("dp") if per_device_params else P()

    def body(g, s, p):
        g = jax.tree.map(lambda x: x[0], g)
        if per_device_params:
            p = jax.tree.map(lambda x: x[0], p)
        u, s = tx.update(g, jc.local_view(s), p)
        if per_device_params:
            u = jax.tree.map(lambda x: x[None], u)
        return u, jc.global_view(s)

    fn = jax.jit(
        jax.shard_map(
            body, mesh=make_mesh(n), in_specs=(P("dp"), specs, p_spec), out_specs=(p_spec, specs)
        )
    )
    host = jax.tree.map(np.asarray, params)
    if per_device_params:
        host = jax.tree.map(lambda x: np.repeat(x[None], n, axis=0), host)
    out = []
    for grads in steps:
        updates, state = fn(grads, state, host)
        updates = jax.tree.map(np.asarray, updates)
        host = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), host, updates)
        out.append((updates, host, jax.tree.map(np.asarray, state)))
    return out


def assert_bitwise_equal(got, want, what=""):
    """Every leaf of ``got`` equal to ``want``'s, bit for bit (same structure, dtype, shape)."""
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def, f"{what}: {got_def} != {want_def}"
    for k, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} leaf {k}"
        np.testing.assert_array_equal(
            a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8), err_msg=f"{what} {k}"
        )
