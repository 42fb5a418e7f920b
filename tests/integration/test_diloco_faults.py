"""A rank killed while a background DiLoCo sync is in flight, under ``jaxcomm launch``: the
survivor raises at the step that needs the sync, with a message naming it, in bounded time."""

import subprocess
import sys
import time

from tests.cli.test_launch import _env
from tests.integration.test_distributed import multiprocess

pytestmark = multiprocess

# Two ranks, DiLoCo H=4, tau=3, int4 with error feedback, background syncs, per-device losses
# (the inner steps send nothing). Fragment 0 syncs after step 4: issued in step 5, merged in
# step 7. Rank 1 dies once its step 5 has run (its sync in flight); rank 0 ignores SIGTERM, so
# only its own check can stop it before the launcher's kill grace.
_TRAIN = """\
import os, signal, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np, optax
import jaxcomm as jc

signal.signal(signal.SIGTERM, signal.SIG_IGN)
info = jc.init_distributed()
out = Path(sys.argv[1])
mesh = jax.make_mesh((info.num_processes,), ("dp",))
params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)}

def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2)

tx = jc.diloco(optax.adam(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True), 4, "dp",
               compressor=jc.Quantize(bits=4, error_feedback=True), overlap_steps=3,
               background=True, sync_timeout=20.0)
step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params, mean_metrics=False)
rng = np.random.default_rng(1 + info.process_id)
for t in range(1, 40):
    batch = (rng.normal(size=(8, 64)).astype(np.float32),) * 2
    state, loss = step(state, batch)
    jax.block_until_ready(loss)
    if t == 5 and info.process_id == 1:
        (out / "killed").write_text("5")
        os.kill(os.getpid(), signal.SIGKILL)
(out / f"finished{info.process_id}").write_text("")
"""


def test_a_rank_killed_mid_sync_stops_the_survivor_with_a_message(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    grace = 60.0
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxcomm",
            "launch",
            "-n",
            "2",
            "--kill-grace",
            str(grace),
            "--timeout",
            "240",
            str(script),
            str(tmp_path),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ended = time.time()
    assert (tmp_path / "killed").exists(), result.stderr
    assert result.returncode != 0, result.stderr
    assert not (tmp_path / "finished0").exists(), "the survivor trained on without the sync"
    output = result.stdout + result.stderr
    assert "background sync of fragment 0 (issued at step 5)" in output, output
    assert "SyncError" in output, output
    elapsed = ended - (tmp_path / "killed").stat().st_mtime
    print(f"from the kill to the end of the run: {elapsed:.1f} s")
    # The survivor raised within its sync_timeout (20 s); its exit may then wait on the dead
    # peer (jax.distributed's shutdown), which the launcher's kill grace bounds.
    assert elapsed < grace + 15, elapsed
