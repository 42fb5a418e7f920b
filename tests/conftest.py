"""Eight simulated CPU devices for every test (must run before jax is imported)."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, PartitionSpec  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
    assert len(jax.devices()) >= NUM_DEVICES, "tests need 8 CPU devices"
    return jax.make_mesh((NUM_DEVICES,), ("dp",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="session")
def explicit_mesh():
    """JAX's default mesh: ``jax.make_mesh`` with Explicit axes."""
    return jax.make_mesh((NUM_DEVICES,), ("dp",))


def split_over(mesh, tree, axis: str | None = None):
    """``tree`` placed with every leaf split on axis 0 over ``axis`` (needed on Explicit meshes,
    where ``shard_map`` does not reshard its inputs)."""
    axis = mesh.axis_names[0] if axis is None else axis
    sharding = jax.sharding.NamedSharding(mesh, PartitionSpec(axis))
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def make_mesh(n: int, name: str = "dp"):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), (name,), axis_types=(AxisType.Auto,))


def run_sharded(fn, mesh, global_tree, global_state, *, out_tree_spec=None, check_vma=True):
    """Run ``fn(local_tree, local_state)`` in shard_map; tree and state split on axis 0."""
    axis = mesh.axis_names[0]
    spec = PartitionSpec(axis)
    out_spec = PartitionSpec() if out_tree_spec is None else out_tree_spec
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, spec), out_specs=(out_spec, spec), check_vma=check_vma
    )
    return jax.jit(mapped)(split_over(mesh, global_tree), split_over(mesh, global_state))
