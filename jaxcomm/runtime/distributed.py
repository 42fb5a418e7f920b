"""Multi-process start-up: pick the collectives backend and call ``jax.distributed``.

DeepSpeed's ``deepspeed.init_distributed`` reads the launcher's environment (torchrun's
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, Open MPI's ``OMPI_COMM_WORLD_*``) and
chooses a communication backend. :func:`init_distributed` does the same for JAX:

* on GPU, XLA drives NCCL itself, so there is nothing to choose;
* on CPU, cross-process collectives need ``jax_cpu_collectives_implementation`` set to
    ``"gloo"`` (TCP) or ``"mpi"`` (through MPItrampoline) before the CPU client is created.

The environment parsing lives in the pure functions :func:`resolve_distributed_env`
(:mod:`jaxcomm.runtime.environment`: torchrun, ``duplex.sh``, Open MPI,
``JAXCOMM_COORDINATOR``) and
:func:`resolve_slurm_env` (here), so it is unit-tested without starting anything.

Who reads which launcher (JAX's own ``jax.distributed.initialize()`` detects SLURM, Open MPI
under ``mpirun`` and TPUs by itself; jaxcomm delegates to it where that does the job):

* torchrun / DeepSpeed (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``): read here; JAX has no torchrun detection. Where
    torchrun's agent serves its store on ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``),
    the JAX coordinator takes ``MASTER_PORT + 1``.
* ``duplex.sh``, the two-host emulation on one machine (``COORD``, ``NPROC``, ``RANK``): read
    here, after torchrun's variables and before Open MPI's and SLURM's.
* Open MPI (``OMPI_COMM_WORLD_*``): rank and size read here; the coordinator from
    ``JAXCOMM_COORDINATOR`` or ``MASTER_ADDR``/``MASTER_PORT``, else (Open MPI 4's ``mpirun``)
    delegated to JAX's Open MPI detection.
* SLURM (``srun``): read here (:func:`resolve_slurm_env`), with JAX's coordinator convention
    (the first node of the step, port ``JAX_COORDINATOR_PORT`` or derived from
    ``SLURM_JOB_ID``), because JAX's SLURM detection makes every process drive GPU
    ``SLURM_LOCALID`` only: with one process per node (the two-level ``("host", "local")``
    layout) each node would contribute a single GPU. Here a process sees all of its node's
    devices when it is alone on its node, and GPU ``SLURM_LOCALID`` when there are several.
    It also falls back to ``SLURM_JOB_NODELIST`` and keeps a suffix after the brackets
    (``n[01-02]-ib`` -> ``n01-ib``), and names the missing variable of an incomplete environment.
* Anything else (TPU VMs, Kubernetes, ``mpi4py``): delegated to JAX's detection.

Example::

    import jaxcomm as jc
    info = jc.init_distributed()   # before any other JAX call
    print(info.process_id, info.num_processes)
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import pkgutil
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax

from jaxcomm._compat import GPU_PLATFORMS, backends_initialized, distributed_global_state
from jaxcomm.runtime.environment import (
    COORDINATOR_ENV,
    DistributedEnv,
    format_address,
    parse_int,
    resolve_distributed_env,
)
from jaxcomm.runtime.host_allocator import configure_host_allocator

logger = logging.getLogger(__name__)

#: Accepted values of ``init_distributed(backend=...)``.
BACKENDS = ("auto", "gloo", "mpi", "nccl")


class DistributedInfo(NamedTuple):
    """What :func:`init_distributed` set up.

    Attributes:
        process_id: This process's index, as ``jax.process_index()`` will report it.
        num_processes: Number of processes, as ``jax.process_count()`` will report it.
        coordinator_address: ``host:port`` of the coordinator service.
        backend: Collectives in use across processes: ``"nccl"`` on GPU, otherwise the CPU
            implementation (``"gloo"`` or ``"mpi"``).
    """

    process_id: int
    num_processes: int
    coordinator_address: str | None
    backend: str


# --------------------------------------------------------------------------------------------
# Backend choice.
# --------------------------------------------------------------------------------------------


def _configured_platforms() -> list[str] | None:
    """Platforms from ``jax_platforms`` / ``JAX_PLATFORMS``, or ``None`` when unrestricted."""
    value = jax.config.jax_platforms
    if not value:
        return None
    return [p.strip().lower() for p in value.split(",") if p.strip()]


def _gpu_plugin_installed() -> bool:
    """Whether a CUDA or ROCm PJRT plugin is installed (checked without starting a backend)."""
    names: list[str] = []
    try:
        import jax_plugins  # type: ignore[import-not-found]

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    try:
        names += [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    except Exception:  # pragma: no cover - broken metadata must not stop start-up
        pass
    return any("cuda" in n.lower() or "rocm" in n.lower() for n in names)


def _gpu_expected() -> bool:
    """Whether JAX will run on GPU, decided without initializing any backend."""
    platforms = _configured_platforms()
    if platforms is not None:
        return platforms[0] in GPU_PLATFORMS
    return _gpu_plugin_installed()


def _check_mpi() -> None:
    lib = os.environ.get("MPITRAMPOLINE_LIB", "")
    if not lib:
        raise RuntimeError(
            "backend='mpi' uses JAX's MPItrampoline: set MPITRAMPOLINE_LIB to the path of an "
            "MPIwrapper library (libmpiwrapper.so) built against your MPI, and launch with "
            "mpirun. Without it, use backend='gloo'."
        )
    if not os.path.exists(lib):
        raise RuntimeError(f"MPITRAMPOLINE_LIB={lib!r} does not exist.")


def _select_backend(backend: str) -> str:
    """Applies ``backend`` to JAX's config and returns the name reported in the info."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}.")
    if backend == "nccl":
        platforms = _configured_platforms()
        if platforms is not None and not any(p in GPU_PLATFORMS for p in platforms):
            raise ValueError(f"backend='nccl' needs a GPU, but jax_platforms={platforms}.")
        # XLA drives NCCL on GPU; there is no flag to set.
        return "nccl"
    if backend in ("gloo", "mpi"):
        if backend == "mpi":
            _check_mpi()
        jax.config.update("jax_cpu_collectives_implementation", backend)
        return backend
    # "auto". The CPU flag only affects CPU devices, so setting it on a GPU machine is
    # harmless; keep an explicit user choice (e.g. JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi).
    current = jax.config.jax_cpu_collectives_implementation
    if current is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        current = "gloo"
    elif current == "mpi":
        _check_mpi()
    return "nccl" if _gpu_expected() else str(current)


def _current_info(backend: str) -> DistributedInfo:
    """Info for an already initialized ``jax.distributed``, read without starting a backend."""
    state = distributed_global_state()  # private (jax 0.8-0.10): starts no backend
    try:
        return DistributedInfo(
            process_id=int(state.process_id),
            num_processes=int(state.num_processes),
            coordinator_address=state.coordinator_address,
            backend=backend,
        )
    except (AttributeError, TypeError):  # pragma: no cover - a newer JAX layout
        # The public calls start the backend, which is allowed once jax.distributed is up.
        return DistributedInfo(jax.process_index(), jax.process_count(), None, backend)


def init_distributed(
    backend: str = "auto",
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    host_allocator: bool | None = None,
) -> DistributedInfo:
    """Chooses the cross-process collectives and initializes ``jax.distributed``.

    Call it before any JAX computation (including ``jax.devices()``). Explicit arguments win,
    each on its own: ``coordinator_address``, ``num_processes`` and ``process_id`` passed are
    used as they are, and the environment variables they replace are not read, so a partial
    launcher environment (``RANK`` without ``WORLD_SIZE``, say) never blocks them. Settings not
    passed are read from the launcher's environment; when several launchers' variables are
    present, the innermost launcher's win:

    1. torchrun / DeepSpeed / ``jaxcomm launch``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
       ``MASTER_PORT`` (so ``srun torchrun`` gives torchrun's settings, not SLURM's);
    2. ``duplex.sh`` (the two-host emulation): ``RANK``, ``NPROC``, ``COORD``, read when
       ``COORD`` and ``NPROC`` are both set and ``WORLD_SIZE`` is not;
    3. Open MPI: ``OMPI_COMM_WORLD_*``;
    4. SLURM's ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``, ...;
    5. none: ``jax.distributed.initialize()`` runs its own cluster detection (TPU,
       Kubernetes, ...).

    ``JAXCOMM_COORDINATOR=host:port`` overrides every launcher's coordinator (but not the
    argument). See :func:`resolve_distributed_env` and :func:`resolve_slurm_env`. If
    ``jax.distributed`` is already initialized, the current settings are returned and nothing
    is re-initialized.

    Backends:

    * ``"auto"``: on GPU nothing is set (XLA uses NCCL); on CPU
        ``jax_cpu_collectives_implementation`` is set to ``"gloo"`` unless already chosen.
    * ``"gloo"``: TCP collectives between CPU processes.
    * ``"mpi"``: CPU collectives through MPItrampoline; needs ``MPITRAMPOLINE_LIB`` pointing at
        an MPIwrapper library built for the local MPI, and an MPI launcher.
    * ``"nccl"``: GPU (XLA's own NCCL); an error if JAX is restricted to non-GPU platforms.

    GPUs a process drives, without ``local_device_ids``: every GPU it sees when it is the only
    process on its node (one process per host, the ``("host", "local")`` mesh layout); GPU
    ``LOCAL_RANK`` (``OMPI_COMM_WORLD_LOCAL_RANK``, ``SLURM_LOCALID``) when the launcher put
    several on the node (``LOCAL_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_SIZE``,
    ``SLURM_STEP_TASKS_PER_NODE``), unless ``CUDA_VISIBLE_DEVICES`` already gives each fewer.

    Args:
        backend: One of ``"auto"``, ``"gloo"``, ``"mpi"``, ``"nccl"``.
        coordinator_address: ``host:port`` of process 0; default from the environment.
        num_processes: Number of processes; default from the environment.
        process_id: This process's rank; default from the environment.
        local_device_ids: Devices visible to this process (GPU); passed to JAX.
        initialization_timeout: Seconds to wait for all processes to connect (JAX's default: 300).
        heartbeat_timeout_seconds: Seconds without heartbeats after which a process counts as
            dead, and every other process aborts (non-zero exit) instead of waiting in a
            collective forever: this bounds a hang on a stopped process or a silent link
            (gloo collectives have no timeout of their own that JAX exposes). Default: the
            ``JAXCOMM_HEARTBEAT_TIMEOUT`` environment variable (``jaxcomm launch
            --heartbeat-timeout`` sets it), else JAX's default: 100.
        host_allocator: Whether to call :func:`jaxcomm.configure_host_allocator` first (glibc
            keeps every step's buffers mapped: without it an XLA:CPU train step pays page
            faults on hundreds of MiB per step). Default: for the CPU backends (``"gloo"``,
            ``"mpi"``).

    Returns:
        A :class:`DistributedInfo`.

    Raises:
        ValueError: Unknown backend, or missing / inconsistent settings (naming the variable).
        RuntimeError: JAX backends already started, or the MPI library is missing.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}.")
    if jax.distributed.is_initialized():
        current = jax.config.jax_cpu_collectives_implementation
        name = "nccl" if backend == "nccl" or _gpu_expected() else str(current)
        _mark_initialized()
        return _current_info(name)
    if backend == "mpi":
        _check_mpi()
    resolved = resolve_distributed_env(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    if resolved.source == "jax":  # no other launcher found: SLURM's variables, if any
        resolved = resolve_slurm_env(os.environ, resolved)
    if coordinator_address is None:
        resolved = _beside_torchrun_store(os.environ, resolved)
    if backends_initialized():
        raise RuntimeError(
            "init_distributed() must run before any JAX computation, jax.devices() or "
            "device_put: the JAX backends are already initialized."
        )
    name = _select_backend(backend)
    if host_allocator or (host_allocator is None and name in ("gloo", "mpi")):
        configure_host_allocator()

    if local_device_ids is None and name == "nccl":
        local_device_ids = _gpu_for_process(resolved, os.environ)
        if local_device_ids is None and not resolved.complete and resolved.local_rank is not None:
            # JAX's detection (which still runs for the coordinator) would restrict the process
            # to GPU local_rank; an empty list is "given" to it and restricts nothing.
            local_device_ids = []

    kwargs: dict[str, object] = {}
    if initialization_timeout is not None:
        kwargs["initialization_timeout"] = int(initialization_timeout)
    heartbeat = _heartbeat_timeout(heartbeat_timeout_seconds)
    if heartbeat is not None:
        kwargs["heartbeat_timeout_seconds"] = heartbeat
    if resolved.complete:
        # Everything is known: keep JAX's detection (e.g. SLURM variables around a torchrun job)
        # from overriding what the launcher said.
        kwargs["cluster_detection_method"] = "deactivate"
    logger.info(
        "jax.distributed.initialize(coordinator=%s, num_processes=%s, process_id=%s) from %s",
        resolved.coordinator_address,
        resolved.num_processes,
        resolved.process_id,
        resolved.source,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=resolved.coordinator_address,
            num_processes=resolved.num_processes,
            process_id=resolved.process_id,
            local_device_ids=local_device_ids,
            **kwargs,  # type: ignore[arg-type]
        )
    except ValueError as e:
        if resolved.source != "jax":
            raise
        raise ValueError(
            f"{e} No launcher environment found: set RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT (torchrun style), COORD, NPROC and RANK (duplex.sh), "
            "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE with "
            f"{COORDINATOR_ENV}, run under SLURM's srun (SLURM_PROCID, SLURM_NTASKS, "
            "SLURM_STEP_NODELIST, SLURM_JOB_ID), or pass coordinator_address, num_processes "
            "and process_id."
        ) from e
    _mark_initialized()
    return _current_info(name)


# --------------------------------------------------------------------------------------------
# SLURM.
# --------------------------------------------------------------------------------------------


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``node[01-02],x`` -> ``node01``,
    ``gpu[7,9-12]`` -> ``gpu7``, ``n[001-002]-ib`` -> ``n001-ib``, ``a,b`` -> ``a``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first entry
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    entry, host = nodelist[:end].strip(), ""
    while "[" in entry:
        pre, _, rest = entry.partition("[")
        inside, sep, entry = rest.partition("]")
        if not sep:
            raise ValueError(f"SLURM hostlist {nodelist!r} has an unclosed '['.")
        host += pre + inside.split(",")[0].split("-")[0]
    host += entry
    if not host:
        raise ValueError(f"SLURM hostlist {nodelist!r} names no host.")
    return host


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: three nodes
    of 2, then one of 1)."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        count, _, times = item.strip().partition("(x")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"node {node_id} is not in the tasks per node {tasks_per_node!r}.")
    return counts[node_id]


def _slurm_port(env: Mapping[str, str]) -> int:
    """JAX's SLURM convention: ``JAX_COORDINATOR_PORT``, else one derived from the job id."""
    for name in ("JAX_COORDINATOR_PORT", "SLURM_JOB_ID"):
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer.") from None
        if name == "JAX_COORDINATOR_PORT":
            if not 0 < value < 65536:
                raise ValueError(f"{name}={raw!r} must be in 1..65535.")
            return value
        return value % 2**12 + (65535 - 2**12 + 1)
    raise ValueError(
        "SLURM_PROCID/SLURM_NTASKS are set but SLURM_JOB_ID is missing: no coordinator port "
        f"(set JAX_COORDINATOR_PORT, or {COORDINATOR_ENV}=host:port)."
    )


def resolve_slurm_env(env: Mapping[str, str], base: DistributedEnv) -> DistributedEnv:
    """Fills what ``base`` (explicit arguments, ``JAXCOMM_COORDINATOR``/``MASTER_ADDR``) leaves
    open from the variables ``srun`` sets; ``base`` unchanged outside SLURM. What ``base``
    already has is kept and its SLURM variables are not read, so a partial SLURM environment
    does not block explicit arguments. :func:`init_distributed` calls it only when no other
    launcher's variables were found (torchrun's or ``duplex.sh``'s inside ``srun`` win).

    Rank ``SLURM_PROCID``; size ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``; coordinator the
    first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``) at
    port ``JAX_COORDINATOR_PORT`` or ``SLURM_JOB_ID % 4096 + 61440`` (JAX's choice); local
    rank ``SLURM_LOCALID``, local size from ``SLURM_STEP_TASKS_PER_NODE`` (or
    ``SLURM_TASKS_PER_NODE``) and ``SLURM_NODEID``.

    Raises:
        ValueError: An incomplete or inconsistent SLURM environment, naming the variable.
    """
    size_var = next(
        (v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if env.get(v, "").strip()), None
    )
    if not env.get("SLURM_PROCID", "").strip() and size_var is None:
        return base
    # What base already has (explicit arguments) is not read: a partial SLURM environment
    # does not block it.
    rank, rank_from = base.process_id, "process_id"
    if rank is None:
        rank, rank_from = parse_int(env, "SLURM_PROCID"), "SLURM_PROCID"
        if rank is None:
            raise ValueError(f"{size_var} is set but SLURM_PROCID is missing.")
    size, size_from = base.num_processes, "num_processes"
    if size is None:
        if size_var is None:
            raise ValueError("SLURM_PROCID is set but SLURM_NTASKS is missing.")
        size, size_from = parse_int(env, size_var, minimum=1), size_var
    assert size is not None
    if rank >= size:
        raise ValueError(f"{rank_from}={rank} must be smaller than {size_from}={size}.")
    coordinator = base.coordinator_address
    if coordinator is None:
        nodelist_var = next(
            (
                v
                for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if env.get(v, "").strip()
            ),
            None,
        )
        if nodelist_var is None:
            raise ValueError(
                "SLURM_PROCID/SLURM_NTASKS are set but no node list is: SLURM_STEP_NODELIST "
                f"(or SLURM_JOB_NODELIST) is missing; or set {COORDINATOR_ENV}=host:port."
            )
        host = first_host(env[nodelist_var])
        coordinator = format_address(host, _slurm_port(env))
    local_rank = parse_int(env, "SLURM_LOCALID")
    local_size = None
    per_node_var = next(
        (v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(v)), None
    )
    node_id = parse_int(env, "SLURM_NODEID")
    if per_node_var is not None:
        try:
            counts = env[per_node_var]
            if node_id is None and len(set(counts.split(","))) == 1 and "(x" not in counts:
                node_id = 0  # one count for every node
            if node_id is not None:
                local_size = tasks_on_node(counts, node_id)
        except ValueError as e:
            raise ValueError(f"{per_node_var}={env[per_node_var]!r}: {e}") from None
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ValueError(f"SLURM_LOCALID={local_rank} must be smaller than {local_size}.")
    return DistributedEnv(coordinator, size, rank, local_rank, local_size, "slurm")


#: torchrun sets it when its agent hosts a TCPStore at ``MASTER_ADDR:MASTER_PORT``.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def _beside_torchrun_store(env: Mapping[str, str], resolved: DistributedEnv) -> DistributedEnv:
    """Under torchrun, whose agent on ``MASTER_ADDR`` already listens on ``MASTER_PORT`` (its
    rendezvous store, shared with the workers: ``TORCHELASTIC_USE_AGENT_STORE=True``), JAX's
    coordinator, which process 0 binds, takes the next port, ``MASTER_PORT + 1``, the same on
    every process. ``JAXCOMM_COORDINATOR`` or ``coordinator_address`` choose another."""
    if (
        resolved.source != "torchrun"
        or env.get(AGENT_STORE_ENV, "").strip().lower() not in ("1", "true")
        or env.get(COORDINATOR_ENV, "").strip()
        or resolved.coordinator_address is None
    ):
        return resolved
    port = parse_int(env, "MASTER_PORT", minimum=1)
    if port is None or port >= 65535:
        raise ValueError(
            f"{AGENT_STORE_ENV} is set: torchrun's store holds MASTER_PORT={port} and the JAX "
            f"coordinator needs MASTER_PORT + 1; set {COORDINATOR_ENV}=host:port instead."
        )
    address = format_address(env["MASTER_ADDR"].strip(), port + 1)
    logger.info("torchrun's agent store holds MASTER_PORT=%s: JAX coordinator at %s", port, address)
    return resolved._replace(coordinator_address=address)


def _gpu_for_process(resolved: DistributedEnv, env: Mapping[str, str]) -> list[int] | None:
    """``local_device_ids`` on GPU: ``None`` (every visible GPU) for a process alone on its
    node, ``[local_rank]`` for one of several, ``None`` too when the launcher already bound
    fewer GPUs than there are processes on the node (``CUDA_VISIBLE_DEVICES`` per task)."""
    if resolved.local_rank is None:
        return None
    local_size = resolved.local_world_size
    if local_size is None:
        # Unknown: JAX's rule under SLURM (one GPU a process); torchrun/Open MPI: all.
        return [resolved.local_rank] if resolved.source == "slurm" else None
    if local_size <= 1:
        return None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in env and len(visible) < local_size:
        return None
    return [resolved.local_rank]


#: Default of ``init_distributed(heartbeat_timeout_seconds=)`` (set by ``jaxcomm launch``).
HEARTBEAT_ENV = "JAXCOMM_HEARTBEAT_TIMEOUT"
#: A file ``init_distributed`` creates when set (``jaxcomm launch`` warns when none appears).
MARKER_ENV = "JAXCOMM_INIT_MARKER"


def _heartbeat_timeout(value: int | None) -> int | None:
    source = "heartbeat_timeout_seconds"
    if value is None:
        raw = os.environ.get(HEARTBEAT_ENV, "").strip()
        if not raw:
            return None
        source = f"{HEARTBEAT_ENV}={raw!r}"
        try:
            value = int(float(raw))
        except ValueError:
            raise ValueError(f"{source} is not a number of seconds.") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source} must be a positive int (seconds), got {value!r}.")
    return value


def _mark_initialized() -> None:
    marker = os.environ.get(MARKER_ENV)
    if marker:
        try:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
        except OSError:  # the launcher's directory is gone: nothing to tell it
            pass
