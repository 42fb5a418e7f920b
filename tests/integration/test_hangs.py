"""Hangs under ``jaxcomm launch``: a stopped rank, a silent link, the first failure by time,
and bad input (busy port, shaping without root, a script that never calls init_distributed)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxcomm.cli import netshape
from jaxcomm.cli.main import main
from tests.cli.test_launch import _alive, _env, _launch
from tests.integration.test_distributed import multiprocess

pytestmark = multiprocess

# Two ranks average a gradient with 1-bit compression every 10 ms over gloo.
_TRAIN = """\
import os, sys, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm as jc

info = jc.init_distributed()
out = Path(sys.argv[1])
(out / f"pid{info.process_id}").write_text(str(os.getpid()))
n = info.num_processes
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
comp = jc.OneBit()
state = jc.init_state(comp, {"g": jnp.zeros(256)}, axis_size=n)
step = jax.jit(jax.shard_map(
    lambda t, s: jc.compressed_pmean(t, s, axis_name="dp", compressor=comp),
    mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp"))))
put = lambda x: jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), x)
state = jax.tree.map(put, state)
for i in range(1_000_000):
    g = {"g": put(np.random.default_rng(i).normal(size=256).astype(np.float32))}
    mean, state = step(g, state)
    jax.block_until_ready(mean)
    if i == 5:
        (out / f"step{info.process_id}").write_text("5")
    time.sleep(0.01)
"""

HEARTBEAT = 4  # seconds
GRACE = 1.0


def _start(tmp_path, *launch_args):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxcomm",
            "launch",
            "-n",
            "2",
            "--kill-grace",
            str(GRACE),
            "--heartbeat-timeout",
            str(HEARTBEAT),
            "--timeout",
            "200",
            *launch_args,
            str(script),
            str(tmp_path),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(launcher, tmp_path):
    deadline = time.monotonic() + 150
    while len(list(tmp_path.glob("step*"))) < 2 and time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    assert len(list(tmp_path.glob("step*"))) == 2, "ranks did not reach step 5"
    return {r: int((tmp_path / f"pid{r}").read_text()) for r in range(2)}


@pytest.mark.parametrize("stopped", [1, 0], ids=["worker", "coordinator"])
def test_stopped_rank_ends_the_run_within_the_heartbeat_timeout(tmp_path, stopped):
    launcher = _start(tmp_path)
    try:
        pids = _wait_for_step(launcher, tmp_path)
        t0 = time.monotonic()
        os.kill(pids[stopped], signal.SIGSTOP)  # alive, silent: no exit for a watchdog to see
        out, err = launcher.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(
        f"stopped rank {stopped}: launcher exited {elapsed:.1f} s later (heartbeat {HEARTBEAT} s)"
    )
    assert launcher.returncode != 0, err
    # The survivor aborted by itself (JAX's heartbeat check), the launcher names the stopped rank.
    assert "Terminating process because the JAX distributed service" in out, out[-3000:]
    assert f"rank {stopped} stopped (SIGSTOP?" in err, err
    # Heartbeat timeout + JAX's heartbeat period (up to the timeout again) + teardown.
    assert elapsed < 2 * HEARTBEAT + GRACE + 10, elapsed
    time.sleep(0.3)
    assert not any(_alive(p) for p in pids.values()), "orphaned rank processes"


def test_hang_timeout_names_a_stopped_rank_without_heartbeats(tmp_path):
    """No jax at all: only the launcher's watchdog can end this run."""
    script = tmp_path / "sleep.py"
    script.write_text(
        "import os, sys, time\n"
        "staged = os.path.join(sys.argv[1], '.pid' + os.environ['RANK'])\n"
        "open(staged, 'w').write(str(os.getpid()))\n"
        "os.replace(staged, os.path.join(sys.argv[1], 'pid' + os.environ['RANK']))\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxcomm",
            "launch",
            "-n",
            "3",
            "--hang-timeout",
            "1.5",
            "--kill-grace",
            "0.5",
            str(script),
            str(tmp_path),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("pid*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int((tmp_path / "pid2").read_text())
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        _, err = launcher.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "rank 2 stopped (SIGSTOP? process state T) and did not resume (hang timeout" in err
    assert 1.5 <= elapsed < 1.5 + 0.5 + 5, elapsed
    assert not _alive(pid)


@pytest.mark.skipif(
    netshape.network_shaping_problem("1gbit") is not None,
    reason=str(netshape.network_shaping_problem("1gbit")),
)
def test_silent_link_ends_the_run_within_the_heartbeat_timeout(tmp_path):
    """All ranks in one shaped namespace; its loopback goes down mid-run (no exit, no reset)."""
    launcher = _start(tmp_path, "--rate", "1gbit")
    try:
        pids = _wait_for_step(launcher, tmp_path)
        t0 = time.monotonic()
        down = subprocess.run(
            ["nsenter", f"--net=/proc/{pids[0]}/ns/net", "ip", "link", "set", "lo", "down"],
            capture_output=True,
            text=True,
        )
        assert down.returncode == 0, down.stderr
        out, err = launcher.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(f"silent link: launcher exited {elapsed:.1f} s later (heartbeat {HEARTBEAT} s)")
    assert launcher.returncode != 0, err
    assert "exited with code" in err and "rank " in err, err
    assert elapsed < 2 * HEARTBEAT + GRACE + 15, elapsed


def test_first_failure_by_time_is_named_not_the_lowest_rank(tmp_path):
    # Rank 2 fails; rank 0 fails ~20 ms later (well inside one 50 ms poll of the launcher).
    script = tmp_path / "fail.py"
    flag = tmp_path / "flag"
    script.write_text(
        "import os, sys, time\n"
        f"flag = {str(flag)!r}\n"
        "rank = int(os.environ['RANK'])\n"
        "time.sleep(1.0)\n"
        "if rank == 2:\n"
        "    open(flag, 'w').close(); os._exit(3)\n"
        "if rank == 0:\n"
        "    while not os.path.exists(flag): time.sleep(0.001)\n"
        "    time.sleep(0.02); os._exit(5)\n"
        "time.sleep(60)\n"
    )
    proc = _launch("-n", "3", "--kill-grace", "0.5", str(script), timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "rank 2 exited with code 3" in proc.stderr, proc.stderr


def test_busy_port_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _launch("-n", "2", "--port", str(port), str(tmp_path / "x.py"), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} on 127.0.0.1 is not free" in proc.stderr


def test_shaping_without_root_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    netshape.network_shaping_problem.cache_clear()
    try:
        code = main(["launch", "-n", "2", "--rate", "1gbit", "x.py"])
    finally:
        netshape.network_shaping_problem.cache_clear()
    assert code == 2
    assert "cannot shape the rate: network shaping needs root" in capsys.readouterr().err


def test_script_without_init_distributed_warns(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("print('hello')\n")
    proc = _launch("-n", "2", str(plain), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "warning: no rank called jc.init_distributed()" in proc.stderr
    assert "2 ranks ran as 2 independent copies" in proc.stderr
    wired = tmp_path / "wired.py"
    wired.write_text("import jaxcomm as jc\njc.init_distributed()\nprint('hello')\n")
    proc = _launch("-n", "2", str(wired), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
