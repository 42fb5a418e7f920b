"""A donated error-feedback state is updated in place, whichever order the step returns
``(mean, state)`` in: the compiled program aliases every state buffer to its input and copies
none of them (read from the compiled HLO)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc

N = 8
NUMEL = 1 << 16


@pytest.mark.parametrize("compressor", [jc.OneBit(), jc.PowerSGD(rank=2)], ids=["onebit", "psgd"])
@pytest.mark.parametrize("state_first", [False, True], ids=["mean_state", "state_mean"])
def test_state_is_aliased_and_never_copied(compressor, state_first):
    mesh = jax.make_mesh((N,), ("dp",))
    split = NamedSharding(mesh, P("dp"))
    like = {"w": jnp.zeros((256, NUMEL // 256))}
    state = jax.device_put(
        jc.stack_per_device(jc.init_state(compressor, like, axis_size=N), N), split
    )
    grads = jax.device_put({"w": jnp.ones((N * 256, NUMEL // 256))}, split)

    def body(g, s):
        mean, s = jc.compressed_pmean(g, s, axis_name="dp", compressor=compressor)
        return (s, mean) if state_first else (mean, s)

    outs = (P("dp"), P()) if state_first else (P(), P("dp"))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=outs),
        donate_argnums=1,
    )
    text = fn.lower(grads, state).compile().as_text()
    n_state = len(jax.tree.leaves(state))
    aliases = re.search(r"input_output_alias=(.*?)entry_computation_layout", text).group(1)
    # every state leaf (parameters 1.. of the entry) is aliased to an output
    aliased_params = {int(p) for p in re.findall(r"\((\d+), \{\}, may-alias\)", aliases)}
    assert aliased_params == set(range(1, 1 + n_state))
    entry = text[text.index("ENTRY") :]
    big_copies = [
        line for line in entry.splitlines() if " copy(" in line and re.search(r"\[\d{5,}", line)
    ]
    assert big_copies == []
