"""``jc.init_distributed()`` under the environments torchrun, duplex.sh, SLURM's srun and Open
MPI set, alone, nested, or beside explicit arguments.

Nothing is started: ``jax.distributed.initialize`` is replaced by a stand-in that records its
arguments and then does what JAX does before it opens a socket (its own cluster detection for
what is left unset, the same errors for what is still missing), so each test sees the
coordinator address, process count and id (and the GPUs a process drives) that JAX would get.
JAX's own SLURM and Open MPI detection serve as the reference where they apply.
"""

from __future__ import annotations

import os

import jax
import pytest
from jax._src import clusters

from jaxcomm.runtime import distributed
from jaxcomm.runtime.distributed import (
    first_host,
    init_distributed,
    resolve_slurm_env,
    tasks_on_node,
)
from jaxcomm.runtime.environment import DUPLEX as DUPLEX_LAUNCHER
from jaxcomm.runtime.environment import DistributedEnv, resolve_distributed_env

LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_COORDINATOR", "KUBERNETES_")
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "JAXCOMM_COORDINATOR",
    "JAXCOMM_INIT_MARKER",
    "JAXCOMM_HEARTBEAT_TIMEOUT",
    "CUDA_VISIBLE_DEVICES",
    "JAX_LOCAL_DEVICE_IDS",
    "TPU_WORKER_HOSTNAMES",
    "TORCHELASTIC_USE_AGENT_STORE",
    "COORD",
    "NPROC",
)

TORCHRUN = {
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29500",
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}
# srun -N 2 --ntasks-per-node=1: one process per node, the second node's.
SLURM = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}
SLURM_PORT = 1234 % 4096 + 61440  # JAX's port for job 1234
OMPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}
ORTE_URI = "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"
# What ../shared/tools/duplex.sh sets in rank 1 of `duplex.sh 1gbit 2 -- python train.py`.
DUPLEX = {
    "RANK": "1",
    "NPROC": "2",
    "COORD": "10.211.0.1:23456",
    "ADDR": "10.211.0.2",
    "ADDRS": "10.211.0.1,10.211.0.2",
    "PORT": "23456",
    "DUPLEX_NS": "dx-4242-ab12-1",
}


@pytest.fixture
def calls(monkeypatch):
    """A clean launcher environment and a recording stand-in for ``jax.distributed.initialize``;
    yields the list of recorded calls (keyword arguments as JAX would finally use them)."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_VARS:
            monkeypatch.delenv(name)
    recorded: list[dict] = []

    def fake_initialize(
        coordinator_address=None,
        num_processes=None,
        process_id=None,
        local_device_ids=None,
        cluster_detection_method=None,
        initialization_timeout=300,
        **kwargs,
    ):
        given = dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            cluster_detection_method=cluster_detection_method,
            **kwargs,
        )
        # JAX's own steps before it connects (jax/_src/distributed.py, State.initialize).
        if cluster_detection_method != "deactivate" and None in (
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids,
        ):
            coordinator_address, num_processes, process_id, local_device_ids = (
                clusters.ClusterEnv.auto_detect_unset_distributed_params(
                    coordinator_address,
                    num_processes,
                    process_id,
                    local_device_ids,
                    cluster_detection_method,
                    initialization_timeout,
                )
            )
        if coordinator_address is None:
            raise ValueError("coordinator_address should be defined.")
        if num_processes is None:
            raise ValueError("Number of processes must be defined.")
        if process_id is None:
            raise ValueError("The process id of the current process must be defined.")
        recorded.append(
            dict(
                given=given,
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                # What JAX makes visible: [] and None both leave every device visible.
                visible=list(local_device_ids) if local_device_ids else None,
            )
        )

    monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "backends_initialized", lambda: False)
    monkeypatch.setattr(distributed, "configure_host_allocator", lambda: None)
    monkeypatch.setattr(
        distributed,
        "_current_info",
        lambda name: distributed.DistributedInfo(
            recorded[-1]["process_id"],
            recorded[-1]["num_processes"],
            recorded[-1]["coordinator_address"],
            name,
        ),
    )
    saved = jax.config.jax_cpu_collectives_implementation
    yield recorded
    jax.config.update("jax_cpu_collectives_implementation", saved)


@pytest.fixture
def on_gpu(monkeypatch):
    """``backend="nccl"`` accepted: JAX restricted to GPU platforms (nothing starts)."""
    monkeypatch.setattr(distributed, "_configured_platforms", lambda: ["cuda"])


def _env(monkeypatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _triple(call: dict) -> tuple:
    return call["coordinator_address"], call["num_processes"], call["process_id"]


# --------------------------------------------------------------------------------------------
# torchrun.
# --------------------------------------------------------------------------------------------


def test_torchrun(calls, monkeypatch):
    _env(monkeypatch, TORCHRUN)
    info = init_distributed("gloo")
    (call,) = calls
    assert _triple(call) == ("10.1.2.3:29500", 8, 3)
    # Everything known: JAX's detection must not override it (e.g. SLURM around torchrun).
    assert call["given"]["cluster_detection_method"] == "deactivate"
    assert call["visible"] is None
    assert info == distributed.DistributedInfo(3, 8, "10.1.2.3:29500", "gloo")


def test_torchrun_inside_slurm_keeps_torchrun_settings(calls, monkeypatch):
    _env(monkeypatch, {**SLURM, **TORCHRUN})
    init_distributed("gloo")
    assert _triple(calls[0]) == ("10.1.2.3:29500", 8, 3)


def test_torchrun_agent_store_port_is_left_to_torch(calls, monkeypatch):
    # torchrun's agent listens on MASTER_PORT itself (its store, shared with the workers).
    _env(monkeypatch, {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    init_distributed("gloo")
    assert _triple(calls[0]) == ("10.1.2.3:29501", 8, 3)
    monkeypatch.setenv("JAXCOMM_COORDINATOR", "10.1.2.3:4000")
    init_distributed("gloo")
    assert _triple(calls[1]) == ("10.1.2.3:4000", 8, 3)
    monkeypatch.delenv("JAXCOMM_COORDINATOR")
    init_distributed("gloo", coordinator_address="10.1.2.3:29500")
    assert _triple(calls[2]) == ("10.1.2.3:29500", 8, 3)


@pytest.mark.parametrize("local_size, visible", [("2", [1]), ("1", None)])
def test_torchrun_gpus_per_process(calls, monkeypatch, on_gpu, local_size, visible):
    _env(monkeypatch, {**TORCHRUN, "LOCAL_WORLD_SIZE": local_size, "LOCAL_RANK": "1"})
    if local_size == "1":
        monkeypatch.setenv("LOCAL_RANK", "0")
    init_distributed("nccl")
    assert calls[0]["visible"] == visible


# --------------------------------------------------------------------------------------------
# SLURM (srun).
# --------------------------------------------------------------------------------------------


def _jax_slurm_triple() -> tuple:
    """What JAX's own SLURM detection reads from the current environment."""
    env = clusters.SlurmCluster
    assert env.is_env_present()
    return (
        env.get_coordinator_address(None, os.environ.get("JAX_COORDINATOR_PORT")),
        env.get_process_count(),
        env.get_process_id(),
    )


def test_slurm_matches_jax_detection(calls, monkeypatch):
    _env(monkeypatch, SLURM)
    init_distributed("gloo")
    (call,) = calls
    assert _triple(call) == (f"node01:{SLURM_PORT}", 2, 1)
    assert _triple(call) == _jax_slurm_triple()
    assert call["given"]["cluster_detection_method"] == "deactivate"


def test_slurm_one_process_per_node_drives_every_gpu(calls, monkeypatch, on_gpu):
    _env(monkeypatch, SLURM)
    init_distributed("nccl")
    # JAX's detection would make this process drive GPU SLURM_LOCALID = 0 only.
    assert calls[0]["visible"] is None


def test_slurm_one_process_per_gpu(calls, monkeypatch, on_gpu):
    env = {
        **SLURM,
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    }
    _env(monkeypatch, env)
    init_distributed("nccl")
    assert _triple(calls[0]) == (f"node01:{SLURM_PORT}", 8, 6)
    assert calls[0]["visible"] == [2]


def test_slurm_gpus_bound_per_task_are_not_renumbered(calls, monkeypatch, on_gpu):
    # srun --gpus-per-task=1: each task sees one GPU, its own; GPU 2 would not exist.
    _env(monkeypatch, {**SLURM, "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"})
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    init_distributed("nccl")
    assert calls[0]["visible"] is None


def test_slurm_job_nodelist_when_no_step_nodelist(calls, monkeypatch):
    env = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP_")}
    _env(monkeypatch, {**env, "SLURM_JOB_NODELIST": "gpu-a[07,09-12],gpu-b3"})
    init_distributed("gloo")
    assert _triple(calls[0]) == (f"gpu-a07:{SLURM_PORT}", 2, 1)


@pytest.mark.parametrize(
    "extra, coordinator",
    [
        ({"JAX_COORDINATOR_PORT": "4321"}, "node01:4321"),
        ({"MASTER_ADDR": "head", "MASTER_PORT": "29500"}, "head:29500"),
        ({"JAXCOMM_COORDINATOR": "10.0.0.9:777"}, "10.0.0.9:777"),
    ],
)
def test_slurm_coordinator_overrides(calls, monkeypatch, extra, coordinator):
    _env(monkeypatch, {**SLURM, **extra})
    init_distributed("gloo")
    assert _triple(calls[0]) == (coordinator, 2, 1)
    if "JAX_COORDINATOR_PORT" in extra:  # JAX reads the same override
        assert _jax_slurm_triple()[0] == coordinator


def test_arguments_win_over_slurm(calls, monkeypatch):
    _env(monkeypatch, SLURM)
    init_distributed("gloo", coordinator_address="127.0.0.1:5", num_processes=4, process_id=3)
    assert _triple(calls[0]) == ("127.0.0.1:5", 4, 3)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node[01-02]", "node01"),
        ("node01", "node01"),
        ("node01,node02", "node01"),
        ("node[001,007-015],host2", "node001"),
        ("gpu[7,9-12]", "gpu7"),
        ("n[001-002]-ib", "n001-ib"),
        ("rack[2-3]-n[05-06]", "rack2-n05"),
        (" a[10-11] ", "a10"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_first_host_agrees_with_jax_where_jax_parses(monkeypatch):
    for nodelist in ("node[01-02]", "node01,node02", "node[001,007-015],host2", "gpu[7,9-12]"):
        monkeypatch.setenv("SLURM_STEP_NODELIST", nodelist)
        monkeypatch.setenv("SLURM_JOB_ID", "1")
        jax_host = clusters.SlurmCluster.get_coordinator_address(None, "1").rsplit(":", 1)[0]
        assert first_host(nodelist) == jax_host


@pytest.mark.parametrize(
    "spec, node, count", [("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4", 0, 4)]
)
def test_tasks_on_node(spec, node, count):
    assert tasks_on_node(spec, node) == count


def test_slurm_resolution_leaves_other_environments_alone():
    base = DistributedEnv(None, None, None)
    assert resolve_slurm_env({"SLURM_JOB_ID": "5", "HOME": "/root"}, base) is base


@pytest.mark.parametrize(
    "drop, replace, variable",
    [
        (("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"), {}, "SLURM_NTASKS"),
        (("SLURM_PROCID",), {}, "SLURM_PROCID"),
        (("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"), {}, "SLURM_STEP_NODELIST"),
        (("SLURM_JOB_ID",), {}, "SLURM_JOB_ID"),
        ((), {"SLURM_PROCID": "2"}, "SLURM_PROCID"),
        ((), {"SLURM_NTASKS": "two", "SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS"),
        ((), {"SLURM_STEP_NODELIST": "node[01-02"}, "node\\[01-02"),
        ((), {"SLURM_LOCALID": "1"}, "SLURM_LOCALID"),
        ((), {"JAX_COORDINATOR_PORT": "99999"}, "JAX_COORDINATOR_PORT"),
    ],
)
def test_incomplete_slurm_names_the_variable(calls, monkeypatch, drop, replace, variable):
    env = {k: v for k, v in SLURM.items() if k not in drop}
    _env(monkeypatch, {**env, **replace})
    with pytest.raises(ValueError, match=variable):
        init_distributed("gloo")
    assert not calls


# --------------------------------------------------------------------------------------------
# Open MPI.
# --------------------------------------------------------------------------------------------


def test_ompi_with_coordinator(calls, monkeypatch):
    _env(monkeypatch, {**OMPI, "JAXCOMM_COORDINATOR": "head:1234"})
    init_distributed("gloo")
    assert _triple(calls[0]) == ("head:1234", 2, 1)
    assert calls[0]["given"]["cluster_detection_method"] == "deactivate"


def test_ompi_mpirun_coordinator_is_delegated_to_jax(calls, monkeypatch, on_gpu):
    # Open MPI 4's mpirun: no coordinator given, JAX derives it from the ORTE URI.
    _env(monkeypatch, {**OMPI, "OMPI_MCA_orte_hnp_uri": ORTE_URI})
    init_distributed("nccl")
    (call,) = calls
    assert call["given"]["coordinator_address"] is None
    assert call["given"]["cluster_detection_method"] is None
    want = clusters.OmpiCluster.get_coordinator_address(None, None)
    assert want.startswith("10.96.0.1:")
    assert _triple(call) == (want, 2, 1)
    # Alone on its node: every GPU, not JAX's GPU OMPI_COMM_WORLD_LOCAL_RANK.
    assert call["visible"] is None


def test_ompi_several_per_node_on_gpu(calls, monkeypatch, on_gpu):
    env = {**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    _env(monkeypatch, {**env, "OMPI_COMM_WORLD_SIZE": "8", "JAXCOMM_COORDINATOR": "h:1"})
    init_distributed("nccl")
    assert calls[0]["visible"] == [1]


def test_ompi_without_coordinator_names_the_variable(calls, monkeypatch):
    _env(monkeypatch, OMPI)
    with pytest.raises(ValueError, match="JAXCOMM_COORDINATOR"):
        init_distributed("gloo")
    assert not calls


# --------------------------------------------------------------------------------------------
# Nothing, or not enough.
# --------------------------------------------------------------------------------------------


def test_no_launcher_is_a_clear_error(calls):
    with pytest.raises(ValueError, match="No launcher environment found.*MASTER_ADDR"):
        init_distributed("gloo")


@pytest.mark.parametrize(
    "env, variable",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ],
)
def test_incomplete_launcher_names_the_variable(calls, monkeypatch, env, variable):
    _env(monkeypatch, env)
    with pytest.raises(ValueError, match=variable):
        init_distributed("gloo")
    assert not calls


# --------------------------------------------------------------------------------------------
# Explicit arguments beside a partial, stray or malformed environment.
# --------------------------------------------------------------------------------------------

ARGS = dict(coordinator_address="127.0.0.1:5", num_processes=4, process_id=3)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "1"},  # a stray rank (or duplex.sh's, read by a script of its own)
        {"WORLD_SIZE": "2"},
        {"RANK": "one", "WORLD_SIZE": "2"},
        {"MASTER_ADDR": "head"},
        {"MASTER_PORT": "29500"},
        {"JAXCOMM_COORDINATOR": "nohostport"},
        {"COORD": "10.211.0.1:23456", "NPROC": "2"},
        {"OMPI_COMM_WORLD_RANK": "0"},
        {"SLURM_PROCID": "0"},
        {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"},
        DUPLEX,
        {**TORCHRUN, **SLURM, **OMPI},
    ],
)
def test_arguments_win_over_a_partial_environment(calls, monkeypatch, env):
    _env(monkeypatch, env)
    info = init_distributed("gloo", **ARGS)
    (call,) = calls
    assert _triple(call) == ("127.0.0.1:5", 4, 3)
    assert call["given"]["cluster_detection_method"] == "deactivate"
    assert (info.coordinator_address, info.num_processes, info.process_id) == ("127.0.0.1:5", 4, 3)


def test_script_passing_duplex_variables_explicitly(calls, monkeypatch):
    # A user's script under duplex.sh that reads its variables itself: RANK is in the
    # environment without WORLD_SIZE, which must not stop the explicit arguments.
    _env(monkeypatch, DUPLEX)
    init_distributed(
        "gloo",
        coordinator_address=os.environ["COORD"],
        num_processes=int(os.environ["NPROC"]),
        process_id=int(os.environ["RANK"]),
    )
    assert _triple(calls[0]) == ("10.211.0.1:23456", 2, 1)


@pytest.mark.parametrize(
    "env, kwargs, want",
    [
        # RANK alone: the size passed, rank and coordinator from torchrun's variables.
        (
            {"RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"},
            {"num_processes": 2},
            ("h:7", 2, 1),
        ),
        ({**TORCHRUN, "RANK": "one"}, {"process_id": 0}, ("10.1.2.3:29500", 8, 0)),
        ({**TORCHRUN, "MASTER_PORT": ""}, {"coordinator_address": "c:1"}, ("c:1", 8, 3)),
        # No task count under srun: the size passed, the rest from SLURM.
        (
            {k: v for k, v in SLURM.items() if "NUM_TASKS" not in k and k != "SLURM_NTASKS"},
            {"num_processes": 2},
            (f"node01:{SLURM_PORT}", 2, 1),
        ),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_PROCID"},
            {"process_id": 0},
            (f"node01:{SLURM_PORT}", 2, 0),
        ),
        (
            {k: v for k, v in DUPLEX.items() if k != "RANK"},
            {"process_id": 0},
            ("10.211.0.1:23456", 2, 0),
        ),
    ],
)
def test_partial_arguments_take_the_rest_from_the_environment(
    calls, monkeypatch, env, kwargs, want
):
    _env(monkeypatch, env)
    init_distributed("gloo", **kwargs)
    assert _triple(calls[0]) == want


def test_an_argument_is_checked_against_the_environment_it_joins(calls, monkeypatch):
    _env(monkeypatch, TORCHRUN)  # RANK=3
    with pytest.raises(ValueError, match="RANK=3 must be smaller than num_processes=2"):
        init_distributed("gloo", num_processes=2)
    assert not calls


# --------------------------------------------------------------------------------------------
# duplex.sh (the two-host emulation), and which launcher wins when several are present.
# --------------------------------------------------------------------------------------------


def test_duplex(calls, monkeypatch):
    _env(monkeypatch, DUPLEX)
    info = init_distributed("gloo")
    (call,) = calls
    assert _triple(call) == ("10.211.0.1:23456", 2, 1)
    assert call["given"]["cluster_detection_method"] == "deactivate"
    assert call["visible"] is None
    assert info == distributed.DistributedInfo(1, 2, "10.211.0.1:23456", "gloo")
    assert resolve_distributed_env(DUPLEX) == DistributedEnv(
        "10.211.0.1:23456", 2, 1, None, None, "duplex"
    )


def test_duplex_variables_match_the_script():
    # The names read are the ones duplex.sh documents in its header.
    script = os.path.join(
        os.path.dirname(__file__), "..", "..", "..", "shared", "tools", "duplex.sh"
    )
    if os.path.exists(script):  # a clone elsewhere checks the names alone
        with open(script) as f:
            header = f.read(4000)
        assert "RANK NPROC COORD (rank 0's ip:port" in header
    assert (DUPLEX_LAUNCHER.rank, DUPLEX_LAUNCHER.size, DUPLEX_LAUNCHER.coordinator) == (
        "RANK",
        "NPROC",
        "COORD",
    )


@pytest.mark.parametrize(
    "envs, source, want",
    [
        # srun torchrun: torchrun's variables, not SLURM's.
        ((SLURM, TORCHRUN), "torchrun", ("10.1.2.3:29500", 8, 3)),
        # srun duplex.sh: duplex.sh's, not SLURM's.
        ((SLURM, DUPLEX), "duplex", ("10.211.0.1:23456", 2, 1)),
        # torchrun inside duplex.sh (or a script that sets torchrun's names from duplex.sh's,
        # as the benchmarks do): torchrun's.
        ((DUPLEX, TORCHRUN), "torchrun", ("10.1.2.3:29500", 8, 3)),
        ((OMPI, TORCHRUN), "torchrun", ("10.1.2.3:29500", 8, 3)),
        ((OMPI, DUPLEX), "duplex", ("10.211.0.1:23456", 2, 1)),
        ((SLURM, OMPI, {"JAXCOMM_COORDINATOR": "h:1"}), "ompi", ("h:1", 2, 1)),
        # A stray NPROC (build scripts set it) or COORD alone is not duplex.sh.
        ((TORCHRUN, {"NPROC": "16"}), "torchrun", ("10.1.2.3:29500", 8, 3)),
        ((SLURM, {"NPROC": "16"}), "slurm", (f"node01:{SLURM_PORT}", 2, 1)),
        ((SLURM, {"COORD": "x:1"}), "slurm", (f"node01:{SLURM_PORT}", 2, 1)),
    ],
)
def test_launcher_precedence(calls, monkeypatch, caplog, envs, source, want):
    for env in envs:
        _env(monkeypatch, env)
    with caplog.at_level("INFO", logger=distributed.__name__):
        init_distributed("gloo")
    assert _triple(calls[0]) == want
    assert caplog.records[-1].getMessage().endswith(f"from {source}")


@pytest.mark.parametrize(
    "extra, coordinator",
    [
        ({"JAXCOMM_COORDINATOR": "10.0.0.9:777"}, "10.0.0.9:777"),  # the override
        ({"MASTER_ADDR": "head", "MASTER_PORT": "29500"}, "10.211.0.1:23456"),  # COORD first
    ],
)
def test_duplex_coordinator_overrides(calls, monkeypatch, extra, coordinator):
    _env(monkeypatch, {**DUPLEX, **extra})
    init_distributed("gloo")
    assert _triple(calls[0]) == (coordinator, 2, 1)
    init_distributed("gloo", coordinator_address="c:2")  # the argument above all
    assert _triple(calls[1]) == ("c:2", 2, 1)


@pytest.mark.parametrize(
    "replace, variable",
    [
        ({"RANK": ""}, "COORD and NPROC are set but RANK is missing"),
        ({"RANK": "2"}, "RANK=2 must be smaller than NPROC=2"),
        ({"NPROC": "two"}, "NPROC"),
        ({"NPROC": "0"}, "NPROC"),
        ({"COORD": "10.211.0.1"}, "COORD"),
    ],
)
def test_incomplete_duplex_names_the_variable(calls, monkeypatch, replace, variable):
    _env(monkeypatch, {**DUPLEX, **replace})
    with pytest.raises(ValueError, match=variable):
        init_distributed("gloo")
    assert not calls
