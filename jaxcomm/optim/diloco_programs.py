"""The device programs of one fragment's background DiLoCo sync.

:mod:`jaxcomm.optim.diloco_background` runs a sync as device programs around host exchanges;
these are the programs, each a ``shard_map`` over the data axis compiled on first use, built
from the stages of :mod:`jaxcomm.optim.diloco_stages`:

* ``issue(theta, params, comm)``: before step ``t_s + 1``, each device's pseudo-gradient
  ``theta_f - x_f`` (fp32, as the single-program step takes it) and the worker stage on it;
* ``worker(pending, comm)``: the worker stage from a stored pseudo-gradient (a sync reissued
  from a restored state);
* ``server(received, kept)`` and ``finish(gathered, workers, servers, kept)``: the server stage
  and the decoding with the non-finite guard's check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomm.compressors import Compressor
from jaxcomm.optim import diloco_stages as stages


class FragmentPrograms:
    """The stage programs of one fragment's sync (see the module docstring)."""

    def __init__(
        self, compressor: Compressor, axis_name: str, bucket_bytes, mesh, leaves, n: int
    ) -> None:
        comp = compressor
        self.plan = p = stages.plan(comp, leaves, bucket_bytes, n)
        per, rep = P(axis_name), P()

        def local(tree):
            return jax.tree.map(lambda x: x[0], tree)

        def block(tree):
            return jax.tree.map(lambda x: x[None], tree)

        def worker(pending, comm):
            wires, residuals = stages.worker(comp, p, local(pending), local(comm), n)
            return block(wires), block(residuals), block(stages.kept(p, local(comm)))

        def issue(theta, params, comm):
            pending = [
                a - jnp.asarray(x, jnp.float32) for a, x in zip(theta, local(params), strict=True)
            ]
            return (block(pending), *worker(block(pending), comm))

        def server(received, kept):
            return block(stages.server(comp, p, local(received), local(kept), n))

        def finish(gathered, workers, servers, kept):
            mean, flags = stages.finish(
                comp, p, gathered, local(workers), local(servers), local(kept), n
            )
            return mean, block(flags)

        def program(fn, in_specs, out_specs):
            mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            return jax.jit(mapped)

        self.issue = program(issue, (rep, per, per), (per, per, per, per))
        self.worker = program(worker, (per, per), (per, per, per))
        self.server = program(server, (per, per), (per, per))
        self.finish = program(finish, (rep, per, per, per), (rep, per))
