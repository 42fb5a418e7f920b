"""One rank of the 2-process test: ``jc.compressed_pmean`` across real processes over gloo.

Started by ``tests/integration/test_distributed.py`` through
:func:`jaxcomm.cli.launch.launch_local`, which sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``. Each process owns one CPU device; the two devices form the mesh axis ``"dp"``.
For each compressor and step the rank saves the (full, replicated) mean tree and its own new
state to ``OUT_DIR/rank{r}.npz``.

Usage: ``python multiprocess_worker.py OUT_DIR [STEPS]``
"""

from __future__ import annotations

import os
import sys

import numpy as np

#: Per-device leaf shapes. Sizes are not multiples of 8n, so 1-bit padding is exercised.
SHAPES = {"bias": (7,), "kernel": (3, 5), "scale": (2, 2, 3)}


def local_tree(rank: int, step: int) -> dict[str, np.ndarray]:
    """The tree rank ``rank`` reduces at ``step``: deterministic from (rank, step)."""
    rng = np.random.default_rng([rank, step])
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in sorted(SHAPES.items())}


def main(out_dir: str, steps: int) -> None:
    # One CPU device per process: must be set before JAX creates its CPU client.
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.runtime import init_distributed

    info = init_distributed("gloo", initialization_timeout=60)
    rank, n = info.process_id, info.num_processes
    assert info.backend == "gloo" and n == int(os.environ["WORLD_SIZE"]), info
    assert init_distributed() == info  # already initialized: same info, no second init
    assert jax.process_index() == rank and len(jax.devices()) == n, jax.devices()

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    sharded = NamedSharding(mesh, P("dp"))

    def to_global(local):
        # Per-device blocks are stacked along axis 0 across processes.
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharded, np.asarray(x)), local
        )

    results: dict[str, np.ndarray] = {}
    for name, comp in (("none", jc.NoCompression()), ("onebit", jc.OneBit())):
        step_fn = jax.jit(
            jax.shard_map(
                lambda t, s, comp=comp: jc.compressed_pmean(t, s, axis_name="dp", compressor=comp),
                mesh=mesh,
                in_specs=(P("dp"), P("dp")),
                out_specs=(P(), P("dp")),
                check_vma=True,
            )
        )
        state = jc.init_state(comp, local_tree(rank, 0), axis_size=n)
        state = to_global(jax.tree.map(np.asarray, state))
        for step in range(steps):
            out, state = step_fn(to_global(local_tree(rank, step)), state)
            for key, leaf in out.items():
                # P() output: every process holds the whole mean.
                results[f"{name}/{step}/out/{key}"] = np.asarray(leaf.addressable_data(0))
            for path, leaf in jax.tree_util.tree_leaves_with_path(state):
                key = jax.tree_util.keystr(path)
                results[f"{name}/{step}/state/{key}"] = np.asarray(leaf.addressable_data(0))
        jax.block_until_ready(state)

    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    print(f"rank {rank}/{n}: wrote {len(results)} arrays", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
