"""Two processes of four CPU devices each: multi-host data parallel as a user starts it.

Each process owns 4 CPU devices (``JAX_NUM_CPU_DEVICES=4``) and calls
``jax.distributed.initialize(COORD, NPROC, RANK)`` itself, like one process per host of a
cluster. Where this runs as root and the repository's ``shared/tools/duplex.sh`` is next to it,
each process lives in its own network namespace (two emulated hosts joined by a veth pair, the
link unshaped); otherwise the two processes talk over 127.0.0.1.

The processes build ``jax.make_mesh((2, 4), ("host", "local"))`` (one ``host`` row per process:
checked) and ``jax.make_mesh((8,), ("dp",))`` (the same 8 devices as one flat axis), and train a
small tanh MLP with ``jc.make_train_step``, each process passing its own rows of the batch:

* ``exact_flat`` / ``exact_tuple``: ``jc.compressed_mean(axis, jc.NoCompression())`` then SGD,
  over ``"dp"`` and over ``("host", "local")``: checked against full-batch gradient descent
  computed here in NumPy (float64);
* ``onebit_flat`` / ``onebit_tuple``: ``jc.onebit_adam`` past its warm-up: both processes hold
  the same parameters bit for bit, and the full-batch loss (NumPy) decreases; the tuple case
  checks the skip cap on the host (``check_skips_on_host=True``, as on GPU: each process reads
  its own shards of the steps' skip reports);
* ``diloco_tuple`` / ``diloco_tuple_bg``: Streaming DiLoCo over ``("host", "local")`` (int4
  outer gradients with error feedback), its syncs in the step programs and in the background
  (device programs around the host links, which cross between the processes): the same state
  bit for bit, on each process, and the same outer parameters on both.

``jc.init_distributed()`` is also started from SLURM's and Open MPI's variables alone (two plain
processes on 127.0.0.1): each finds its rank, the coordinator and all of its 4 devices.

The module is also the worker: ``python test_multihost.py OUT_DIR`` runs one process's share.
``JAXCOMM_MULTIHOST_NO_NETNS=1`` forces the plain-process fallback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

NPROC = 2
LOCAL_DEVICES = 4
ROWS_PER_DEVICE = 4
D_IN, D_HIDDEN, D_OUT = 6, 5, 3
SGD_LR = 0.2
SGD_STEPS = 5
ONEBIT_LR = 0.02
ONEBIT_FREEZE = 2
ONEBIT_STEPS = 12
DILOCO_STEPS = 12  # H=6, F=2, tau=2: syncs issued before steps 4, 7 and 10, none in flight at 12
TIMEOUT_S = 240  # the whole run; it takes ~40-80 s on 2 shared cores

CASES = (
    *("exact_flat", "exact_tuple", "onebit_flat", "onebit_tuple"),
    *("diloco_tuple", "diloco_tuple_bg"),
)
TUPLE = ("host", "local")


# --------------------------------------------------------------------------------------------
# The model, its data and the NumPy reference (no JAX).
# --------------------------------------------------------------------------------------------


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "b1": (0.1 * rng.standard_normal(D_HIDDEN)).astype(np.float32),
        "b2": np.zeros(D_OUT, np.float32),
        "w1": (rng.standard_normal((D_IN, D_HIDDEN)) / np.sqrt(D_IN)).astype(np.float32),
        "w2": (rng.standard_normal((D_HIDDEN, D_OUT)) / np.sqrt(D_HIDDEN)).astype(np.float32),
    }


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """All 8 devices' rows of ``step``, process 0's first (each process passes its half)."""
    n = NPROC * LOCAL_DEVICES * ROWS_PER_DEVICE
    rng = np.random.default_rng([1, step])
    x = rng.standard_normal((n, D_IN)).astype(np.float32)
    y = np.sin(x[:, :D_OUT] * 1.5 + 0.3).astype(np.float32)  # a learnable target
    return x, y


def process_rows(batch, rank: int):
    per = LOCAL_DEVICES * ROWS_PER_DEVICE
    return tuple(a[rank * per : (rank + 1) * per] for a in batch)


def np_loss_and_grad(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    """Mean-square loss of the whole batch and its gradient, by hand, in float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x, y = x.astype(np.float64), y.astype(np.float64)
    h = np.tanh(x @ p["w1"] + p["b1"])
    out = h @ p["w2"] + p["b2"]
    loss = np.mean((out - y) ** 2)
    d_out = 2.0 * (out - y) / out.size
    dh = (d_out @ p["w2"].T) * (1.0 - h**2)
    grads = {"b1": dh.sum(0), "b2": d_out.sum(0), "w1": x.T @ dh, "w2": h.T @ d_out}
    return loss, grads


def np_full_batch_gd(steps: int, lr: float) -> dict[str, np.ndarray]:
    p = {k: v.astype(np.float64) for k, v in init_params().items()}
    for step in range(steps):
        _, g = np_loss_and_grad(p, *global_batch(step))
        p = {k: p[k] - lr * g[k] for k in p}
    return p


def np_mean_loss(p: dict[str, np.ndarray], steps: int) -> float:
    """Mean full-batch loss over the batches of the first ``steps`` steps."""
    return float(np.mean([np_loss_and_grad(p, *global_batch(s))[0] for s in range(steps)]))


# --------------------------------------------------------------------------------------------
# The worker (one process; started by the test below).
# --------------------------------------------------------------------------------------------


def worker(out_dir: str) -> None:
    import jax

    jax.distributed.initialize(
        os.environ["COORD"], int(os.environ["NPROC"]), int(os.environ["RANK"])
    )
    import jax.numpy as jnp
    import optax

    import jaxcomm as jc

    rank = jax.process_index()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    assert jax.process_count() == NPROC and jax.local_device_count() == LOCAL_DEVICES

    mesh = jax.make_mesh((NPROC, LOCAL_DEVICES), TUPLE)
    rows = [{d.process_index for d in row} for row in mesh.devices]
    # JAX's default order must put each process's devices on one "host" row.
    results["host_rows"] = np.array([sorted(r) for r in rows])
    flat = jax.make_mesh((NPROC * LOCAL_DEVICES,), ("dp",))
    results["flat_is_rows"] = np.array(
        [d.id for d in flat.devices.flat] == [d.id for d in mesh.devices.flat]
    )

    def loss_fn(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    def run(name, m, axis, tx, steps, **options):
        try:
            step, state = jc.make_train_step(m, axis, loss_fn, tx, init_params(), **options)
            losses = []
            for s in range(steps):
                state, loss = step(state, process_rows(global_batch(s), rank))
                losses.append(float(loss))
            step.check_skips()
            for k, leaf in state.params.items():
                results[f"{name}/{k}"] = np.asarray(leaf.addressable_data(0))
            results[f"{name}/losses"] = np.array(losses)
        except Exception:  # recorded for the test, which says what failed
            errors[name] = traceback.format_exc(limit=4)

    for name, m, axis in (("exact_flat", flat, "dp"), ("exact_tuple", mesh, TUPLE)):
        tx = optax.chain(jc.compressed_mean(axis, jc.NoCompression()), optax.sgd(SGD_LR))
        run(name, m, axis, tx, SGD_STEPS)
    for name, m, axis in (("onebit_flat", flat, "dp"), ("onebit_tuple", mesh, TUPLE)):
        tx = jc.onebit_adam(ONEBIT_LR, freeze_step=ONEBIT_FREEZE, axis_name=axis)
        run(name, m, axis, tx, ONEBIT_STEPS, check_skips_on_host=name == "onebit_tuple")

    for name, background in (("diloco_tuple", False), ("diloco_tuple_bg", True)):
        try:
            tx = jc.diloco(
                optax.adam(0.02),
                optax.sgd(0.7, momentum=0.9, nesterov=True),
                6,
                TUPLE,
                compressor=jc.Quantize(bits=4, error_feedback=True),
                fragments=2,
                overlap_steps=2,
                background=background,
            )
            step, state = jc.make_train_step(mesh, TUPLE, loss_fn, tx, init_params())
            for s in range(DILOCO_STEPS):
                state, _ = step(state, process_rows(global_batch(s), rank))
            opt = state.opt_state
            state = state._replace(opt_state=opt._replace(local=opt.local._replace(pending=())))
            for i, leaf in enumerate(jax.tree.leaves(state)):  # this process's shards
                results[f"{name}/leaf{i}"] = np.stack([s.data for s in leaf.addressable_shards])
            for k, leaf in jc.diloco_params(opt).items():
                results[f"{name}/theta_{k}"] = np.asarray(leaf.addressable_data(0))
            sent = step.background._links.sent_bytes if background else 0
            results[f"{name}/sent"] = np.array(sent)
        except Exception:
            errors[name] = traceback.format_exc(limit=4)

    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    Path(out_dir, f"rank{rank}.errors").write_text(
        "".join(f"== {k}\n{v}\n" for k, v in errors.items())
    )
    print(f"rank {rank}: done ({len(errors)} case(s) failed)", flush=True)
    jax.distributed.shutdown()


def init_worker(out_dir: str) -> None:
    """``jc.init_distributed()`` from the launcher's variables alone, then a sum over all 8
    devices (each adds its process id + 1)."""
    import jax

    import jaxcomm as jc

    info = jc.init_distributed()
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), TUPLE)
    mine = np.full((jax.local_device_count(),), info.process_id + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(TUPLE)), mine)
    total = jax.jit(
        jax.shard_map(lambda a: lax.psum(a, TUPLE), mesh=mesh, in_specs=P(TUPLE), out_specs=P())
    )(x)
    result = dict(
        info=list(info),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        total=float(np.asarray(total.addressable_data(0))[0]),
    )
    Path(out_dir, f"init{info.process_id}.json").write_text(json.dumps(result))
    jax.distributed.shutdown()


# --------------------------------------------------------------------------------------------
# The launcher side.
# --------------------------------------------------------------------------------------------


def duplex_script() -> Path | None:
    """``<repo>/../shared/tools/duplex.sh`` when it exists and can run here (root, ``ip``)."""
    path = REPO.parent / "shared" / "tools" / "duplex.sh"
    if os.environ.get("JAXCOMM_MULTIHOST_NO_NETNS"):
        return None
    if not path.is_file() or os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
LAUNCHER_VARS = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("JAXCOMM_COORDINATOR", "JAX_COORDINATOR_PORT"),
)


def _worker_env() -> dict[str, str]:
    # Without the variables of a launcher this test may itself run under (SLURM in CI).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_VARS
    }
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(LOCAL_DEVICES),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        # One CPU device count for the workers, whatever this test session simulates.
        XLA_FLAGS=" ".join(
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ),
    )
    return env


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def launch(out_dir: Path, rank_envs: list[dict[str, str]] | None = None) -> str:
    """Runs both workers; returns how (for messages). Raises with their output on failure.

    ``rank_envs``: plain processes on 127.0.0.1 with these variables each, running
    :func:`init_worker`; otherwise :func:`worker`, with ``RANK``, ``NPROC`` and ``COORD``.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out_dir)]
    if rank_envs is not None:
        cmd.insert(2, "--init")
    env = _worker_env()
    duplex = duplex_script() if rank_envs is None else None
    procs: list[subprocess.Popen] = []
    logs = [out_dir / f"launch{i}.log" for i in range(NPROC)]
    try:
        if duplex is not None:
            how = f"{duplex.name} (a network namespace per process)"
            env.update(DUPLEX_TIMEOUT=str(TIMEOUT_S - 20), DUPLEX_GRACE="10")
            with open(logs[0], "w") as log:
                procs.append(
                    subprocess.Popen(
                        ["bash", str(duplex), "none", str(NPROC), "--", *cmd],
                        env=env,
                        cwd=str(REPO),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        else:
            how = "plain processes on 127.0.0.1"
            coord = f"127.0.0.1:{_free_port()}"
            for rank in range(NPROC):
                rank_env = {**env, "RANK": str(rank), "NPROC": str(NPROC), "COORD": coord}
                if rank_envs is not None:
                    rank_env = {**env, **rank_envs[rank]}
                with open(logs[rank], "w") as log:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            env=rank_env,
                            cwd=str(REPO),
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {TIMEOUT_S} s")
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # let the other rank fail by itself, then stop it
                break
            time.sleep(0.2)
    except BaseException as e:
        for p in procs:
            _kill(p)
        raise RuntimeError(f"{how}: {e}\n{_read_logs(logs)}") from e
    for p in procs:
        _kill(p)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{how}: exit codes {codes}\n{_read_logs(logs)}")
    return how


def _read_logs(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in logs if p.exists())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    launch(out)
    results = [dict(np.load(out / f"rank{r}.npz")) for r in range(NPROC)]
    errors = [(out / f"rank{r}.errors").read_text() for r in range(NPROC)]
    return results, errors


def _case(ranks, name: str) -> list[dict[str, np.ndarray]]:
    results, errors = ranks
    failed = [e for e in errors if f"== {name}\n" in e]
    if failed:
        pytest.fail(f"{name} raised in the workers:\n{failed[0]}")
    return [
        {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith(name + "/")} for r in results
    ]


def test_default_mesh_puts_each_process_on_one_host_row(ranks):
    for r in ranks[0]:
        np.testing.assert_array_equal(r["host_rows"], [[0], [1]])
        assert bool(r["flat_is_rows"])


def _check_exact(ranks, name):
    want = np_full_batch_gd(SGD_STEPS, SGD_LR)
    start = init_params()
    for rank, got in enumerate(_case(ranks, name)):
        for k in want:
            # The test would not notice a step that does nothing.
            assert np.max(np.abs(want[k] - start[k])) > 1e-3, k
            np.testing.assert_allclose(
                got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"rank {rank} {name} {k}"
            )


def _check_onebit(ranks, name):
    a, b = _case(ranks, name)
    for k in init_params():
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} {k}: processes disagree")
    np.testing.assert_array_equal(a["losses"], b["losses"])
    before = np_mean_loss(init_params(), ONEBIT_STEPS)
    after = np_mean_loss({k: a[k] for k in init_params()}, ONEBIT_STEPS)
    assert after < 0.9 * before, (before, after)
    assert np.all(np.isfinite(a["losses"]))


def test_exact_mean_flat_axis_is_full_batch_gd(ranks):
    _check_exact(ranks, "exact_flat")


def test_exact_mean_tuple_axis_is_full_batch_gd(ranks):
    _check_exact(ranks, "exact_tuple")


def test_onebit_adam_flat_axis_processes_agree_and_learn(ranks):
    _check_onebit(ranks, "onebit_flat")


def test_onebit_adam_tuple_axis_processes_agree_and_learn(ranks):
    _check_onebit(ranks, "onebit_tuple")


def test_background_diloco_over_the_tuple_is_the_step_programs_bit_for_bit(ranks):
    """Each process's shards of the whole state (parameters, outer and inner states, error
    feedback) are the same with the syncs in the background as in the step programs; the
    background's wires did cross to the other process; the outer parameters agree across
    processes."""
    cases = _case(ranks, "diloco_tuple"), _case(ranks, "diloco_tuple_bg")
    for rank, (want, got) in enumerate(zip(*cases, strict=True)):
        leaves = [k for k in want if k.startswith("leaf")]
        assert sorted(leaves) == sorted(k for k in got if k.startswith("leaf"))
        for k in leaves:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"rank {rank} {k}")
        assert int(got["sent"]) > 0 and int(want["sent"]) == 0
    (a, b) = cases[1]
    for k in init_params():
        np.testing.assert_array_equal(a[f"theta_{k}"], b[f"theta_{k}"], err_msg=k)
        assert np.max(np.abs(a[f"theta_{k}"] - init_params()[k])) > 1e-3, k  # it trained


def _launcher_env(launcher: str, rank: int, port: int) -> dict[str, str]:
    if launcher == "slurm":  # srun -n 2 on one node
        return {
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_NTASKS": str(NPROC),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": str(NPROC),
            "JAX_COORDINATOR_PORT": str(port),
        }
    return {  # mpirun -np 2, the coordinator named by the user
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(NPROC),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(NPROC),
        "JAXCOMM_COORDINATOR": f"127.0.0.1:{port}",
    }


@pytest.mark.parametrize("launcher", ["slurm", "ompi"])
def test_init_distributed_from_launcher_environment(tmp_path, launcher):
    port = _free_port()
    launch(tmp_path, [_launcher_env(launcher, r, port) for r in range(NPROC)])
    for rank in range(NPROC):
        got = json.loads((tmp_path / f"init{rank}.json").read_text())
        assert got["info"] == [rank, NPROC, f"127.0.0.1:{port}", "gloo"], got
        assert (got["process_index"], got["process_count"]) == (rank, NPROC)
        assert got["local_devices"] == LOCAL_DEVICES
        assert got["total"] == LOCAL_DEVICES * sum(r + 1 for r in range(NPROC))


def test_numpy_reference_gradient_matches_finite_differences():
    """The reference itself: its gradient against central differences (float64)."""
    p = {k: v.astype(np.float64) for k, v in init_params().items()}
    x, y = global_batch(0)
    _, g = np_loss_and_grad(p, x, y)
    eps = 1e-6
    for k in p:
        for idx in [(0,) * p[k].ndim, tuple(s - 1 for s in p[k].shape)]:
            hi = {**p, k: p[k].copy()}
            lo = {**p, k: p[k].copy()}
            hi[k][idx] += eps
            lo[k][idx] -= eps
            fd = (np_loss_and_grad(hi, x, y)[0] - np_loss_and_grad(lo, x, y)[0]) / (2 * eps)
            assert abs(fd - g[k][idx]) < 1e-7 + 1e-5 * abs(fd), (k, idx, fd, g[k][idx])


if __name__ == "__main__":
    if sys.argv[1] == "--init":
        init_worker(sys.argv[2])
    else:
        worker(sys.argv[1])
