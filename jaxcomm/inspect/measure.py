"""Bytes on the wire of programs on a mesh: split by mesh axes, or of one compressed mean.

Both read the compiled HLO through :mod:`jaxcomm.inspect.hlo`, the one counter of collectives
and wire bytes: :func:`wire_bytes_by_axes` splits a program's bytes by the mesh axes its
collectives cross; :func:`mean_wire_bytes` compiles one ``jc.compressed_pmean`` of a tree and
counts its bytes (the demo's and the benchmarks' traffic columns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm.all_reduce import compressed_pmean
from jaxcomm.comm.state import init_state
from jaxcomm.inspect.hlo import collectives_in_hlo, compiled_text, replica_groups, wire_bytes


def wire_bytes_by_axes(text: str, mesh: jax.sharding.Mesh) -> dict[tuple[str, ...], float]:
    """Bytes each device sends, keyed by the mesh axes its collectives' groups span.

    Device ids in the HLO are positions in ``mesh.devices.flat`` (one replica, SPMD partitions);
    a group spans axis ``a`` when its members differ in their ``a`` coordinate. On a
    ``("node", "local")`` mesh, ``result[("node",)]`` is what crosses the slow axis alone.
    """
    shape = mesh.devices.shape
    names = tuple(mesh.axis_names)
    out: dict[tuple[str, ...], float] = {}
    for op in collectives_in_hlo(text):
        groups = replica_groups(op.line, int(np.prod(shape)))
        spanned = set()
        for group in groups:
            coords = np.array(np.unravel_index(np.array(group), shape))  # (ndim, members)
            spanned |= {names[a] for a in range(len(shape)) if len(set(coords[a])) > 1}
        key = tuple(n for n in names if n in spanned)
        out[key] = out.get(key, 0.0) + op.wire_bytes
    return out


def mean_wire_bytes(mesh, axis: str, tree, compressor, bucket_bytes: int | None = None) -> float:
    """Bytes per device on the wire of one ``jc.compressed_pmean`` of an fp32 tree shaped like
    ``tree`` (a pytree of arrays or shape structs), inside ``shard_map`` over ``axis``, read
    from the compiled HLO (nothing runs).

    ``mesh`` may have any axis types: JAX's default ``jax.make_mesh(...)`` (Explicit axes) and
    an Auto mesh give the same count, since each device's share is laid out on ``axis`` before
    the program is traced. With ``n = mesh.shape[axis]`` devices and ``numel`` elements in all
    leaves, the exact mean (``jc.NoCompression()``) costs the ring all-reduce's
    ``2 (n-1)/n * 4 * numel`` bytes per device; a compressor's count follows the formula in its
    docstring (``jc.OneBit()``: ``2 (n-1)/n * (Np/8 + 4n)`` for one bucket, ``Np`` its length
    padded to a multiple of ``8n``: the packed signs and one fp32 scale per row, both stages).
    """
    n = mesh.shape[axis]
    # Each argument's sharding says where its rows live: on a mesh with Explicit axes (JAX's
    # default) shard_map takes its inputs as typed, and an unsharded one would not match P(axis).
    split = NamedSharding(mesh, P(axis))
    local = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), tree)
    glob = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct((n, *p.shape), jnp.float32, sharding=split), local
    )
    state = init_state(compressor, local, axis_size=n, bucket_bytes=bucket_bytes)
    g_state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype, sharding=split), state
    )

    def body(t, s):
        t, s = jax.tree.map(lambda x: x[0], (t, s))
        if not jax.tree.leaves(s):
            s = None
        out, s = compressed_pmean(
            t, s, axis_name=axis, compressor=compressor, bucket_bytes=bucket_bytes
        )
        return out, jax.tree.map(lambda x: x[None], s)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=(P(), P(axis)))
    )
    return wire_bytes(compiled_text(fn, glob, g_state))
