"""``jaxcomm.inspect.measure`` on the meshes users make: JAX's default ``jax.make_mesh``
(Explicit axes) and an Auto mesh, byte counts against the closed forms the docstrings state."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.inspect import compiled_text, mean_wire_bytes, wire_bytes_by_axes
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES
TREE = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((96,))}
NUMEL = 64 * 32 + 96


def _meshes(shape, names):
    """The default mesh exactly as a user makes it, and the same one with Auto axes."""
    return {
        "default": jax.make_mesh(shape, names),
        "auto": jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names)),
    }


def test_the_default_mesh_has_explicit_axes():
    # What the tests below rely on: jax.make_mesh's default is not Auto.
    assert jax.make_mesh((N,), ("dp",)).axis_types == (AxisType.Explicit,)


@pytest.mark.parametrize("kind", ["default", "auto"])
@pytest.mark.parametrize("n", [2, N])
def test_mean_wire_bytes_exact_mean_is_the_ring_all_reduce(kind, n):
    mesh = _meshes((n,), ("dp",))[kind]
    got = mean_wire_bytes(mesh, "dp", TREE, jc.NoCompression())
    assert got == pytest.approx(2 * (n - 1) / n * 4 * NUMEL, rel=1e-12)


@pytest.mark.parametrize("kind", ["default", "auto"])
@pytest.mark.parametrize("n", [2, N])
def test_mean_wire_bytes_onebit_is_its_formula(kind, n):
    mesh = _meshes((n,), ("dp",))[kind]
    numel = 1000  # one bucket, padded to a multiple of 8n
    padded = -(-numel // (8 * n)) * 8 * n
    got = mean_wire_bytes(mesh, "dp", {"x": jnp.zeros((numel,))}, jc.OneBit())
    assert got == pytest.approx(2 * (n - 1) / n * (padded / 8 + 4 * n), rel=1e-12)


def test_mean_wire_bytes_over_one_axis_of_a_default_two_axis_mesh():
    for mesh in _meshes((2, N // 2), ("host", "local")).values():
        assert mean_wire_bytes(mesh, "host", TREE, jc.NoCompression()) == pytest.approx(
            2 * (2 - 1) / 2 * 4 * NUMEL
        )
        local = N // 2
        assert mean_wire_bytes(mesh, "local", TREE, jc.NoCompression()) == pytest.approx(
            2 * (local - 1) / local * 4 * NUMEL
        )


def _psum_both_axes(mesh):
    """Compiled text of one psum over ``local`` and one over ``host`` of a ``(64,)`` f32 row
    per device, its input laid out on both axes (as an Explicit mesh needs)."""
    spec = P(("host", "local"))

    def body(x):
        return lax.psum(lax.psum(x, "local") * 2, "host")

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.ShapeDtypeStruct((N * 64,), jnp.float32, sharding=NamedSharding(mesh, spec))
    return compiled_text(fn, x)


@pytest.mark.parametrize("kind", ["default", "auto"])
def test_wire_bytes_by_axes_on_a_default_mesh(kind):
    mesh = _meshes((2, N // 2), ("host", "local"))[kind]
    got = wire_bytes_by_axes(_psum_both_axes(mesh), mesh)
    local = N // 2
    assert got == pytest.approx(
        {("local",): 2 * (local - 1) / local * 4 * 64, ("host",): 2 * (2 - 1) / 2 * 4 * 64}
    )
