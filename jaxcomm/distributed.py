"""Multi-process start-up: pick the collectives backend and call ``jax.distributed``.

DeepSpeed's ``deepspeed.init_distributed`` reads the launcher's environment (torchrun's
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, Open MPI's ``OMPI_COMM_WORLD_*``) and
chooses a communication backend. :func:`init_distributed` does the same for JAX:

* on GPU, XLA drives NCCL itself, so there is nothing to choose;
* on CPU, cross-process collectives need ``jax_cpu_collectives_implementation`` set to
    ``"gloo"`` (TCP) or ``"mpi"`` (through MPItrampoline) before the CPU client is created.

The environment parsing lives in the pure function :func:`resolve_distributed_env`, so it can
be unit-tested without starting anything.

Example::

    import jaxcomm as jc
    info = jc.distributed.init_distributed()   # before any other JAX call
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

logger = logging.getLogger(__name__)

#: Accepted values of ``init_distributed(backend=...)``.
BACKENDS = ("auto", "gloo", "mpi", "nccl")

#: Coordinator override (``host:port``) for launchers that do not set ``MASTER_ADDR``.
COORDINATOR_ENV = "JAXCOMM_COORDINATOR"


class DistributedEnv(NamedTuple):
    """Distributed settings resolved from arguments and environment, before start-up.

    Attributes:
        coordinator_address: ``host:port`` of process 0's coordinator service, or ``None`` to let
            JAX's cluster detection (SLURM, Open MPI with ``mpirun``, TPU, ...) find it.
        num_processes: Total number of processes, or ``None`` (left to JAX's detection).
        process_id: This process's rank in ``[0, num_processes)``, or ``None``.
        local_rank: Rank of this process on its node (``LOCAL_RANK``), if known.
        local_world_size: Number of processes on this node (``LOCAL_WORLD_SIZE``), if known.
        source: Where the settings came from: ``"arguments"``, ``"torchrun"``, ``"ompi"`` or
            ``"jax"`` (nothing found; JAX's own cluster detection will run).
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_rank: int | None = None
    local_world_size: int | None = None
    source: str = "jax"

    @property
    def complete(self) -> bool:
        """Whether coordinator, size and rank are all known (JAX's detection is not needed)."""
        return None not in (self.coordinator_address, self.num_processes, self.process_id)


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
# Environment resolution (pure).
# --------------------------------------------------------------------------------------------


def _parse_int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    """Reads ``env[name]`` as an integer ``>= minimum``; ``None`` when unset or empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer.") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}.")
    return value


def _format_address(host: str, port: int) -> str:
    # Bare IPv6 literals need brackets, or the port is ambiguous.
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _check_address(address: str, name: str) -> str:
    """Validates a ``host:port`` string; ``name`` says where it came from."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{name}={address!r} must have the form host:port.")
    try:
        port_num = int(port)
    except ValueError:
        raise ValueError(f"{name}={address!r}: port {port!r} is not an integer.") from None
    if not 0 < port_num < 65536:
        raise ValueError(f"{name}={address!r}: port must be in 1..65535.")
    return address.strip()


def _coordinator_from_env(env: Mapping[str, str]) -> str | None:
    """``JAXCOMM_COORDINATOR`` if set, else ``MASTER_ADDR:MASTER_PORT``, else ``None``."""
    override = env.get(COORDINATOR_ENV, "").strip()
    if override:
        return _check_address(override, COORDINATOR_ENV)
    addr = env.get("MASTER_ADDR", "").strip()
    port = env.get("MASTER_PORT", "").strip()
    if addr and not port:
        raise ValueError("MASTER_ADDR is set but MASTER_PORT is missing.")
    if port and not addr:
        raise ValueError("MASTER_PORT is set but MASTER_ADDR is missing.")
    if not addr:
        return None
    port_num = _parse_int(env, "MASTER_PORT", minimum=1)
    assert port_num is not None
    if port_num > 65535:
        raise ValueError(f"MASTER_PORT={port!r} must be in 1..65535.")
    return _format_address(addr, port_num)


def _rank_and_size(
    env: Mapping[str, str], rank_var: str, size_var: str
) -> tuple[int | None, int | None]:
    """Reads a (rank, world size) pair; both or neither must be set, and rank < size."""
    rank = _parse_int(env, rank_var)
    size = _parse_int(env, size_var, minimum=1)
    if rank is not None and size is None:
        raise ValueError(f"{rank_var} is set but {size_var} is missing.")
    if size is not None and rank is None:
        raise ValueError(f"{size_var} is set but {rank_var} is missing.")
    if rank is not None and size is not None and rank >= size:
        raise ValueError(f"{rank_var}={rank} must be smaller than {size_var}={size}.")
    return rank, size


def resolve_distributed_env(
    env: Mapping[str, str] | None = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> DistributedEnv:
    """Resolves coordinator, world size and rank from arguments and launcher environment.

    Explicit arguments win over the environment. The environment is read in this order:

    1. torchrun / DeepSpeed: ``RANK``, ``WORLD_SIZE`` (both required if either is set),
          ``MASTER_ADDR`` + ``MASTER_PORT`` (required), optional ``LOCAL_RANK`` and
          ``LOCAL_WORLD_SIZE``.
    2. Open MPI: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
          ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``; the coordinator comes from
          ``JAXCOMM_COORDINATOR`` or ``MASTER_ADDR``/``MASTER_PORT``, or (under ``mpirun`` of Open
          MPI 4, which sets ``OMPI_MCA_orte_hnp_uri``) from JAX's own Open MPI detection.
    3. Nothing found: every field is ``None`` and ``jax.distributed.initialize()`` detects the
          cluster itself (SLURM, TPU, Kubernetes, ...).

    ``JAXCOMM_COORDINATOR=host:port`` overrides ``MASTER_ADDR``/``MASTER_PORT`` in all cases.

    Args:
        env: Environment mapping; defaults to ``os.environ``.
        coordinator_address: Explicit ``host:port``; overrides the environment.
        num_processes: Explicit number of processes; overrides the environment.
        process_id: Explicit rank; overrides the environment.

    Returns:
        The resolved :class:`DistributedEnv`.

    Raises:
        ValueError: Missing, non-integer or inconsistent settings. The message names the variable.
    """
    env = os.environ if env is None else env

    local_rank: int | None = None
    local_size: int | None = None
    env_coord = _coordinator_from_env(env)
    source = "jax"

    if "RANK" in env or "WORLD_SIZE" in env:
        rank, size = _rank_and_size(env, "RANK", "WORLD_SIZE")
        local_rank = _parse_int(env, "LOCAL_RANK")
        local_size = _parse_int(env, "LOCAL_WORLD_SIZE", minimum=1)
        if env_coord is None and coordinator_address is None:
            raise ValueError(
                "RANK/WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are missing "
                f"(or set {COORDINATOR_ENV}=host:port)."
            )
        source = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        rank, size = _rank_and_size(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local_rank = _parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _parse_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
        if (
            env_coord is None
            and coordinator_address is None
            and "OMPI_MCA_orte_hnp_uri" not in env  # JAX can derive it from this one.
        ):
            raise ValueError(
                "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE are set but no coordinator is known: "
                f"set {COORDINATOR_ENV}=host:port or MASTER_ADDR and MASTER_PORT."
            )
        source = "ompi"
    else:
        rank = size = None

    if coordinator_address is not None:
        coord: str | None = _check_address(coordinator_address, "coordinator_address")
    else:
        coord = env_coord

    if num_processes is not None:
        if num_processes < 1:
            raise ValueError(f"num_processes={num_processes} must be >= 1.")
        size = num_processes
    if process_id is not None:
        if process_id < 0:
            raise ValueError(f"process_id={process_id} must be >= 0.")
        rank = process_id
    if rank is not None and size is not None and rank >= size:
        raise ValueError(f"process_id={rank} must be smaller than num_processes={size}.")
    if None not in (coordinator_address, num_processes, process_id):
        source = "arguments"
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ValueError(f"local rank {local_rank} must be smaller than local size {local_size}.")

    return DistributedEnv(
        coordinator_address=coord,
        num_processes=size,
        process_id=rank,
        local_rank=local_rank,
        local_world_size=local_size,
        source=source,
    )


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
        return platforms[0] in ("gpu", "cuda", "rocm")
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


def backends_initialized() -> bool:
    """Whether JAX has created its backends (too late then for jax.distributed and XLA flags)."""
    # jax._src.xla_bridge is private but stable for years; if it moves, fall back to letting
    # jax.distributed.initialize raise its own error.
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover
        return False


def _select_backend(backend: str) -> str:
    """Applies ``backend`` to JAX's config and returns the name reported in the info."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}.")
    if backend == "nccl":
        platforms = _configured_platforms()
        if platforms is not None and not any(p in ("gpu", "cuda", "rocm") for p in platforms):
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
    try:  # private (jax 0.8-0.10): the only place that does not start a backend
        from jax._src import distributed as _dist

        state = _dist.global_state
        return DistributedInfo(
            process_id=int(state.process_id),
            num_processes=int(state.num_processes),
            coordinator_address=state.coordinator_address,
            backend=backend,
        )
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a newer JAX layout
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
) -> DistributedInfo:
    """Chooses the cross-process collectives and initializes ``jax.distributed``.

    Call it before any JAX computation (including ``jax.devices()``). Settings not passed as
    arguments are read from the launcher's environment, see :func:`resolve_distributed_env`;
    if the environment names no launcher, ``jax.distributed.initialize()`` runs its own cluster
    detection (SLURM, Open MPI, TPU, ...). If ``jax.distributed`` is already initialized, the
    current settings are returned and nothing is re-initialized.

    Backends:

    * ``"auto"``: on GPU nothing is set (XLA uses NCCL); on CPU
        ``jax_cpu_collectives_implementation`` is set to ``"gloo"`` unless already chosen.
    * ``"gloo"``: TCP collectives between CPU processes.
    * ``"mpi"``: CPU collectives through MPItrampoline; needs ``MPITRAMPOLINE_LIB`` pointing at
        an MPIwrapper library built for the local MPI, and an MPI launcher.
    * ``"nccl"``: GPU (XLA's own NCCL); an error if JAX is restricted to non-GPU platforms.

    With ``LOCAL_WORLD_SIZE > 1`` processes per node on GPU (torchrun / Open MPI style, one
    process per GPU) and no ``local_device_ids``, each process gets GPU ``LOCAL_RANK``.

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
            --heartbeat-timeout`` sets it), else JAX's default, 100 s.


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
    if backends_initialized():
        raise RuntimeError(
            "init_distributed() must run before any JAX computation, jax.devices() or "
            "device_put: the JAX backends are already initialized."
        )
    name = _select_backend(backend)

    if (
        local_device_ids is None
        and name == "nccl"
        and resolved.local_rank is not None
        and (resolved.local_world_size or 1) > 1
    ):
        local_device_ids = [resolved.local_rank]

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
            "MASTER_PORT (torchrun style), OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE with "
            f"{COORDINATOR_ENV}, run under SLURM, or pass coordinator_address, num_processes "
            "and process_id."
        ) from e
    _mark_initialized()
    return _current_info(name)


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
