"""init_distributed's environment handling, the local launcher, and a real 2-process run.

The 2-process tests start separate Python processes joined by ``jax.distributed`` with gloo on
127.0.0.1 (one CPU device each) and check ``jc.compressed_pmean`` across them: NoCompression
against the exact mean, OneBit against an independent NumPy model. They skip where processes
cannot talk over loopback TCP or jaxlib has no gloo, or with ``JAXCOMM_SKIP_MULTIPROCESS=1``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcomm.cli.launch import LaunchError, launch_local
from jaxcomm.cli.netshape import network_shaping_problem
from jaxcomm.runtime import DistributedEnv, init_distributed, resolve_distributed_env
from tests.integration.multiprocess_worker import local_tree
from tests.reference.onebit_reference import init_state as np_init_state
from tests.reference.onebit_reference import onebit_allreduce_mean

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

TORCHRUN = {
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29500",
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


# --------------------------------------------------------------------------------------------
# Environment resolution (no processes started).
# --------------------------------------------------------------------------------------------


def test_torchrun_env():
    got = resolve_distributed_env(TORCHRUN)
    assert got == DistributedEnv("10.1.2.3:29500", 8, 3, 1, 2, "torchrun")
    assert got.complete


def test_ompi_env_with_master_addr():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "1234",
    }
    assert resolve_distributed_env(env) == DistributedEnv("node0:1234", 4, 2, 0, None, "ompi")


def test_ompi_env_coordinator_override_and_orte_fallback():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    got = resolve_distributed_env({**env, "JAXCOMM_COORDINATOR": "head:777"})
    assert got.coordinator_address == "head:777" and got.complete
    # Under Open MPI 4's mpirun JAX derives the coordinator itself.
    got = resolve_distributed_env({**env, "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"})
    assert got.coordinator_address is None and not got.complete and got.source == "ompi"


def test_empty_env_defers_to_jax_detection():
    got = resolve_distributed_env({})
    assert got == DistributedEnv(None, None, None, None, None, "jax")
    assert not got.complete


def test_arguments_override_env():
    got = resolve_distributed_env(
        TORCHRUN, coordinator_address="127.0.0.1:5", num_processes=2, process_id=1
    )
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("127.0.0.1:5", 2, 1)
    assert got.source == "arguments"


def test_ipv6_master_addr_is_bracketed():
    env = {**TORCHRUN, "MASTER_ADDR": "fd00::1"}
    assert resolve_distributed_env(env).coordinator_address == "[fd00::1]:29500"


@pytest.mark.parametrize(
    "env, variable",
    [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK"),
        ({**TORCHRUN, "RANK": "8"}, "RANK"),
        ({**TORCHRUN, "RANK": "one"}, "RANK"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({**TORCHRUN, "LOCAL_RANK": "x"}, "LOCAL_RANK"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_RANK"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "JAXCOMM_COORDINATOR"),
        ({**TORCHRUN, "JAXCOMM_COORDINATOR": "nohostport"}, "JAXCOMM_COORDINATOR"),
    ],
)
def test_bad_env_names_the_variable(env, variable):
    with pytest.raises(ValueError, match=variable):
        resolve_distributed_env(env)


def test_bad_arguments():
    with pytest.raises(ValueError, match="process_id"):
        resolve_distributed_env({}, coordinator_address="a:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator_address"):
        resolve_distributed_env({}, coordinator_address="a")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        init_distributed("tcp")


def test_mpi_without_library_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MPITRAMPOLINE_LIB", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    if jax.distributed.is_initialized():  # pragma: no cover - a foreign test set it up
        pytest.skip("jax.distributed already initialized in this process")
    with pytest.raises(RuntimeError, match="MPITRAMPOLINE_LIB"):
        init_distributed("mpi")


def test_after_backend_start_is_refused(monkeypatch):
    # The test process has used JAX already (other tests), or does so now.
    jax.devices()
    if jax.distributed.is_initialized():  # pragma: no cover
        pytest.skip("jax.distributed already initialized in this process")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        init_distributed("gloo")


# --------------------------------------------------------------------------------------------
# Multi-process.
# --------------------------------------------------------------------------------------------


def _multiprocess_problem() -> str | None:
    if os.environ.get("JAXCOMM_SKIP_MULTIPROCESS"):
        return "JAXCOMM_SKIP_MULTIPROCESS is set"
    if not sys.platform.startswith("linux"):
        return "multi-process tests use Linux process groups"
    try:
        from jax._src.lib import _jax

        if not hasattr(_jax, "make_gloo_tcp_collectives"):
            return "this jaxlib has no gloo CPU collectives"
    except ImportError:  # pragma: no cover
        return "cannot inspect jaxlib for gloo"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:  # pragma: no cover
        return f"cannot bind on 127.0.0.1: {e}"
    return None


multiprocess = pytest.mark.skipif(
    _multiprocess_problem() is not None, reason=str(_multiprocess_problem())
)

STEPS = 3
WORLD = 2


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    """Runs tests/integration/multiprocess_worker.py on 2 processes once; returns each rank's
    arrays."""
    out = tmp_path_factory.mktemp("mp")
    result = launch_local(
        WORLD,
        [sys.executable, str(HERE / "multiprocess_worker.py"), str(out), str(STEPS)],
        env={
            # One CPU device per process, whatever the test session simulates for itself.
            "JAX_NUM_CPU_DEVICES": "1",
            "XLA_FLAGS": " ".join(
                f
                for f in os.environ.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")
            ),
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
        },
        cwd=str(REPO),
        timeout=120,
    )
    if not result.ok:
        raise LaunchError(result)
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD)]


@multiprocess
def test_two_process_no_compression_is_exact_mean(two_process_results):
    for step in range(STEPS):
        trees = [local_tree(r, step) for r in range(WORLD)]
        for key in trees[0]:
            want = np.mean([t[key] for t in trees], axis=0)
            for rank, got in enumerate(two_process_results):
                np.testing.assert_allclose(
                    got[f"none/{step}/out/{key}"],
                    want,
                    rtol=1e-6,
                    atol=1e-7,
                    err_msg=f"rank {rank} step {step} leaf {key}",
                )


@multiprocess
def test_two_process_onebit_matches_numpy_model(two_process_results):
    keys = sorted(local_tree(0, 0))  # jax.tree order of a dict: sorted keys
    sizes = [local_tree(0, 0)[k].size for k in keys]
    numel = sum(sizes)
    states = np_init_state(numel, WORLD)
    for step in range(STEPS):
        trees = [local_tree(r, step) for r in range(WORLD)]
        flats = [np.concatenate([t[k].reshape(-1) for k in keys]) for t in trees]
        mean, states = onebit_allreduce_mean(flats, states)
        pieces = np.split(mean, np.cumsum(sizes)[:-1])
        for rank, got in enumerate(two_process_results):
            for key, want in zip(keys, pieces, strict=True):
                np.testing.assert_allclose(
                    got[f"onebit/{step}/out/{key}"].reshape(-1),
                    want,
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"rank {rank} step {step} leaf {key}",
                )
            # Each rank's error feedback is its own device's slice of the global state.
            worker_error, server_error = states[rank]
            np.testing.assert_allclose(
                got[f"onebit/{step}/state/.buckets[0].worker_error"],
                worker_error,
                rtol=1e-5,
                atol=1e-6,
            )
            np.testing.assert_allclose(
                got[f"onebit/{step}/state/.buckets[0].server_error"],
                server_error,
                rtol=1e-5,
                atol=1e-6,
            )


@multiprocess
def test_two_process_ranks_agree(two_process_results):
    a, b = two_process_results
    for key in a:
        if "/out/" in key:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# --------------------------------------------------------------------------------------------
# Launcher.
# --------------------------------------------------------------------------------------------

_FAIL_OR_SLEEP = (
    "import os, sys, time\n"
    "if os.environ['RANK'] == '1':\n"
    "    print('rank 1 failing', flush=True); sys.exit(3)\n"
    "print('rank 0 sleeping', flush=True); time.sleep(60)\n"
)


@multiprocess
def test_launcher_kills_survivors_and_names_failed_rank():
    start = time.monotonic()
    result = launch_local(2, [sys.executable, "-c", _FAIL_OR_SLEEP], timeout=30, kill_grace=1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"sleeper was not killed promptly ({elapsed:.1f}s)"
    assert not result.ok and not result.timed_out
    assert result.failed_rank == 1
    assert result.returncodes[1] == 3
    assert result.returncodes[0] < 0  # killed by the launcher
    assert "rank 1 exited with code 3" in result.describe()
    assert "[rank 1] rank 1 failing" in result.output
    with pytest.raises(LaunchError, match="rank 1 exited with code 3"):
        result.check()


@multiprocess
def test_launcher_env_and_timeout():
    code = (
        "import os\n"
        "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'],"
        " os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])\n"
    )
    result = launch_local(3, [sys.executable, "-c", code], port=12345, timeout=30).check()
    assert [o.split() for o in result.outputs] == [
        [str(r), "3", str(r), "127.0.0.1", "12345"] for r in range(3)
    ]
    result = launch_local(2, [sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert result.timed_out and not result.ok and result.failed_rank is None
    assert result.elapsed < 10


_NETNS_PROBLEM = network_shaping_problem("100mbit")


@pytest.mark.skipif(_NETNS_PROBLEM is not None, reason=str(_NETNS_PROBLEM))
def test_launcher_shaped_namespace_is_shared_and_private():
    code = (
        "import os, socket\n"
        "print(os.readlink('/proc/self/ns/net'), socket.gethostname(),"
        " sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
    )
    result = launch_local(2, [sys.executable, "-c", code], netns_rate="100mbit", timeout=30)
    result.check()
    (ns0, host0, devs0), (ns1, host1, devs1) = (o.split(" ", 2) for o in result.outputs)
    assert ns0 == ns1 != os.readlink("/proc/self/ns/net")  # one namespace, not ours
    assert host0 == host1 == "localhost" and devs0 == devs1 == "['lo']"
