"""A rank killed mid-run under ``jaxcomm launch``: bounded teardown, named rank, no orphans."""

import os
import signal
import subprocess
import sys
import time

from tests.cli.test_launch import _alive, _env
from tests.integration.test_distributed import multiprocess

pytestmark = multiprocess

# Four ranks train with compressed_pmean over gloo; every rank ignores SIGTERM, so the
# survivors (blocked in a collective waiting for the dead rank) stop only at the launcher's
# SIGKILL after --kill-grace seconds: the bound is the configured grace, not their goodwill.
_TRAIN = """\
import os, signal, sys, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm as jc

signal.signal(signal.SIGTERM, signal.SIG_IGN)
info = jc.init_distributed()
out = Path(sys.argv[1])
(out / f"pid{info.process_id}").write_text(str(os.getpid()))
n = info.num_processes
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
comp = jc.OneBit()
local = {"g": jnp.zeros(1024)}
step = jax.jit(jax.shard_map(
    lambda t, s: jc.compressed_pmean(t, s, axis_name="dp", compressor=comp),
    mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp"))))
put = lambda x: jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), x)
# The stacked layout (n, *local): each process passes its own device's row.
state = jax.tree.map(lambda s: put(np.asarray(s)[None]), jc.init_state(comp, local, axis_size=n))
for i in range(1_000_000):
    g = {"g": put(np.random.default_rng(i).normal(size=1024).astype(np.float32))}
    mean, state = step(g, state)
    jax.block_until_ready(mean)
    if i == 5:
        (out / f"step{info.process_id}").write_text("5")
    time.sleep(0.01)
"""


def test_killed_rank_stops_the_others_in_bounded_time(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    grace = 3.0
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxcomm", "launch", "-n", "4", "--kill-grace", str(grace),
         "--timeout", "240", str(script), str(tmp_path)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("step*"))) < 4 and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.1)
        assert len(list(tmp_path.glob("step*"))) == 4, "ranks did not reach step 5"
        pids = {r: int((tmp_path / f"pid{r}").read_text()) for r in range(4)}
        killed_at = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)  # mid-run: the others are in or between collectives
        out, err = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(f"teardown after the kill: {elapsed:.1f} s (kill grace {grace} s)")
    assert launcher.returncode != 0, err
    assert "rank 2 exited with code -9" in err, err
    # At most poll interval + SIGTERM (ignored) + grace + SIGKILL.
    assert elapsed < grace + 10, elapsed
    time.sleep(0.3)
    assert not any(_alive(p) for p in pids.values()), "orphaned rank processes"
