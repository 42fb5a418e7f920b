"""The ``jaxcomm launch`` command, run as a real subprocess: wiring, prefixes, failure path."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxcomm.cli.netshape import network_shaping_problem
from tests.integration.test_distributed import multiprocess

REPO = Path(__file__).resolve().parents[2]
pytestmark = multiprocess


def _env():
    flags = " ".join(
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    return {
        **os.environ,
        "JAX_NUM_CPU_DEVICES": "1",
        "XLA_FLAGS": flags,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


def _launch(*args, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "jaxcomm", "launch", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status  # a zombie is dead, just not yet reaped


_DISTRIBUTED = """\
import jax, numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm as jc

info = jc.init_distributed()
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("dp")), np.array([info.process_id + 1.0], np.float32))
total = jax.jit(jax.shard_map(lambda v: lax.psum(v, "dp"), mesh=mesh, in_specs=P("dp"),
                              out_specs=P()))(x)
print(f"rank {info.process_id} of {info.num_processes}: sum {float(total.addressable_data(0)[0])}")
jax.distributed.shutdown()
"""


def test_launch_wires_ranks_for_jax_distributed(tmp_path):
    script = tmp_path / "psum.py"
    script.write_text(_DISTRIBUTED)
    proc = _launch("-n", "3", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ": sum " in ln]
    # Each line carries its rank's prefix; 1 + 2 + 3 = 6 on every rank.
    assert sorted(lines) == [f"[rank {r}] rank {r} of 3: sum 6.0" for r in range(3)]


def test_launch_passes_arguments_and_env(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'],"
        " *sys.argv[1:])\n"
    )
    proc = _launch("-n", "2", str(script), "--flag", "x y")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"[rank {r}] {r} 2 127.0.0.1 --flag x y" for r in range(2)
    ]
    proc = _launch("-n", "2", "-m", "platform")  # a module, like python -m
    assert proc.returncode == 0 and proc.stdout.count("[rank ") == 2


_FAIL = """\
import os, sys, time
from pathlib import Path
rank = os.environ["RANK"]
# written whole, then renamed: the test may read the file the moment it appears
staged = Path(sys.argv[1]).parent / f".pid{rank}"
staged.write_text(str(os.getpid()))
os.replace(staged, Path(sys.argv[1], rank))
if rank == "1":
    while len(os.listdir(sys.argv[1])) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)  # every rank has started before this one fails
    print("rank 1 giving up", flush=True)
    sys.exit(3)
time.sleep(120)
"""


def test_failed_rank_stops_the_others_and_is_named(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(_FAIL)
    pids = tmp_path / "pids"
    pids.mkdir()
    start = time.monotonic()
    proc = _launch("-n", "3", "--kill-grace", "1", str(script), str(pids), timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    assert elapsed < 15, f"survivors not stopped promptly ({elapsed:.1f}s)"
    assert "rank 1 exited with code 3" in proc.stderr
    assert "[rank 1] rank 1 giving up" in proc.stdout
    survivors = [int((pids / r).read_text()) for r in ("0", "2")]
    time.sleep(0.2)
    assert not any(_alive(p) for p in survivors), "orphaned rank processes"


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(_FAIL.replace('rank == "1"', "False"))
    pids = tmp_path / "pids"
    pids.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxcomm", "launch", "-n", "2", str(script), str(pids)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [int(p.read_text()) for p in pids.iterdir()]
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=15)
    finally:
        launcher.kill()
    assert launcher.returncode == 130 and "all ranks stopped" in err
    time.sleep(0.2)
    assert not any(_alive(p) for p in ranks)


def test_launch_usage_errors(tmp_path):
    proc = _launch("-n", "2")
    assert proc.returncode == 2 and "name a script" in proc.stderr
    proc = _launch("-n", "0", "x.py")
    assert proc.returncode == 2 and "-n must be >= 1" in proc.stderr
    proc = _launch("-n", "2", "--delay", "1parsec", "x.py")
    assert proc.returncode == 2 and "1parsec" in proc.stderr


_PING = """import os, socket, statistics, sys, time
from pathlib import Path
rank, port_file = os.environ["RANK"], Path(sys.argv[1])
if rank == "0":
    srv = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(srv.getsockname()[1]))
    conn, _ = srv.accept()
    while data := conn.recv(64):
        conn.sendall(data)
else:
    while not port_file.exists() or not port_file.read_text():
        time.sleep(0.01)
    s = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(30):
        t0 = time.perf_counter()
        s.sendall(b"x")
        s.recv(1)
        rtts.append(time.perf_counter() - t0)
    print(f"rtt_ms {1e3 * statistics.median(rtts):.3f}")
"""


def _median_rtt_ms(tmp_path, name, *launch_args):
    script = tmp_path / "ping.py"
    script.write_text(_PING)
    proc = _launch("-n", "2", *launch_args, str(script), str(tmp_path / name))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "rtt_ms" in ln]
    return float(line.split()[-1]), proc.stderr


def test_launch_delay_applies_to_connections_between_ranks(tmp_path):
    """--delay 2ms: a TCP ping-pong between ranks takes >= 2 x 2 ms (netem or the relay)."""
    from jaxcomm.cli._delay import shim_problem

    if network_shaping_problem(None, "2ms") is not None and shim_problem() is not None:
        pytest.skip(f"no way to add a delay here: {shim_problem()}")
    plain, _ = _median_rtt_ms(tmp_path, "plain")
    delayed, err = _median_rtt_ms(tmp_path, "delayed", "--delay", "2ms")
    assert "delay 2ms one way" in err
    assert 4.0 <= delayed < 4.0 + 20, delayed
    assert plain < delayed


def test_parse_delay():
    from jaxcomm.cli._delay import parse_delay

    assert parse_delay("1ms") == 1e-3
    assert parse_delay("500us") == 5e-4
    assert parse_delay(" 0.25 s") == 0.25
    for bad in ("1", "1parsec", "ms", "-1ms"):
        with pytest.raises(ValueError, match="cannot read delay"):
            parse_delay(bad)


def test_relay_refuses_like_a_closed_port():
    """Through the relay, connecting to a port nobody listens on fails as it would directly."""
    from jaxcomm.cli._delay import delay_relay, shim_problem
    from jaxcomm.cli._proc import find_free_port

    if shim_problem():
        pytest.skip(shim_problem())
    code = (
        "import socket, sys\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10)\n"
        "except ConnectionRefusedError:\n"
        "    print('refused')\n"
    )
    port = find_free_port()
    with delay_relay("1ms") as env:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(port)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.stdout.strip() == "refused", proc.stderr
