"""Which process am I: coordinator, world size and rank from a launcher's environment (pure).

:func:`resolve_distributed_env` reads what torchrun / DeepSpeed / ``jaxcomm launch``
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), ``duplex.sh``
(``COORD``, ``NPROC``, ``RANK``) or Open MPI (``OMPI_COMM_WORLD_*``) set, plus the
``JAXCOMM_COORDINATOR`` override, with explicit arguments winning, and checks it, without
starting anything, so it is unit-tested on plain dicts.
:func:`jaxcomm.init_distributed` then starts ``jax.distributed`` with the result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

#: Coordinator override (``host:port``), above every launcher's own.
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
        source: Where the settings came from: ``"arguments"`` (all three passed),
            ``"torchrun"``, ``"duplex"``, ``"ompi"``, ``"slurm"`` (from
            :func:`jaxcomm.runtime.distributed.resolve_slurm_env`) or ``"jax"`` (nothing found;
            JAX's own cluster detection will run).
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


def parse_int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
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


def format_address(host: str, port: int) -> str:
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


class Launcher(NamedTuple):
    """The variables one launcher sets for each process."""

    name: str  #: ``DistributedEnv.source`` when its variables are read.
    rank: str
    size: str
    coordinator: str | None = None  #: its own ``host:port`` variable, if it has one
    local_rank: str | None = None
    local_size: str | None = None


#: torchrun / DeepSpeed / ``jaxcomm launch`` (coordinator: ``MASTER_ADDR`` + ``MASTER_PORT``).
TORCHRUN = Launcher("torchrun", "RANK", "WORLD_SIZE", None, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: ``duplex.sh``, the two-host emulation (one network namespace per rank on one machine).
DUPLEX = Launcher("duplex", "RANK", "NPROC", "COORD")
#: Open MPI's ``mpirun``.
OMPI = Launcher(
    "ompi",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    None,
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)


def _is_set(env: Mapping[str, str], name: str) -> bool:
    return bool(env.get(name, "").strip())


def detect_launcher(env: Mapping[str, str]) -> Launcher | None:
    """The launcher whose variables ``env`` holds, the innermost one first when several are
    present (``srun torchrun``, a ``torchrun`` inside ``duplex.sh``).

    torchrun when ``WORLD_SIZE`` is set; else ``duplex.sh`` when ``COORD`` and ``NPROC`` are
    both set (either alone is not enough: ``NPROC`` is a common shell variable); else torchrun
    when ``RANK`` is set; else Open MPI when ``OMPI_COMM_WORLD_RANK`` or
    ``OMPI_COMM_WORLD_SIZE`` is set; else ``None``. Empty variables count as unset. SLURM is
    read after all of these (:func:`jaxcomm.runtime.distributed.resolve_slurm_env`).
    """
    if _is_set(env, "WORLD_SIZE"):
        return TORCHRUN
    if _is_set(env, "COORD") and _is_set(env, "NPROC"):
        return DUPLEX
    if _is_set(env, "RANK"):
        return TORCHRUN
    if _is_set(env, "OMPI_COMM_WORLD_RANK") or _is_set(env, "OMPI_COMM_WORLD_SIZE"):
        return OMPI
    return None


def _coordinator_from_env(env: Mapping[str, str], launcher: Launcher | None) -> str | None:
    """``JAXCOMM_COORDINATOR`` if set, else the launcher's own variable (``duplex.sh``'s
    ``COORD``), else ``MASTER_ADDR:MASTER_PORT``, else ``None``."""
    override = env.get(COORDINATOR_ENV, "").strip()
    if override:
        return _check_address(override, COORDINATOR_ENV)
    if launcher is not None and launcher.coordinator is not None:
        if _is_set(env, launcher.coordinator):
            return _check_address(env[launcher.coordinator], launcher.coordinator)
    addr = env.get("MASTER_ADDR", "").strip()
    port = env.get("MASTER_PORT", "").strip()
    if addr and not port:
        raise ValueError("MASTER_ADDR is set but MASTER_PORT is missing.")
    if port and not addr:
        raise ValueError("MASTER_PORT is set but MASTER_ADDR is missing.")
    if not addr:
        return None
    port_num = parse_int(env, "MASTER_PORT", minimum=1)
    assert port_num is not None
    if port_num > 65535:
        raise ValueError(f"MASTER_PORT={port!r} must be in 1..65535.")
    return format_address(addr, port_num)


def rank_and_size(
    env: Mapping[str, str], rank_var: str, size_var: str
) -> tuple[int | None, int | None]:
    """Reads a (rank, world size) pair; both or neither must be set, and rank < size."""
    rank = parse_int(env, rank_var)
    size = parse_int(env, size_var, minimum=1)
    if rank is not None and size is None:
        raise ValueError(f"{rank_var} is set but {size_var} is missing.")
    if size is not None and rank is None:
        raise ValueError(f"{size_var} is set but {rank_var} is missing.")
    if rank is not None and size is not None and rank >= size:
        raise ValueError(f"{rank_var}={rank} must be smaller than {size_var}={size}.")
    return rank, size


def _seen(env: Mapping[str, str], launcher: Launcher) -> str:
    """The launcher's variables that are set, for an error message: ``"COORD and NPROC are"``."""
    names = [v for v in (launcher.coordinator, launcher.rank, launcher.size) if v]
    found = [v for v in names if _is_set(env, v)]
    return f"{' and '.join(found)} {'is' if len(found) == 1 else 'are'}"


def resolve_distributed_env(
    env: Mapping[str, str] | None = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> DistributedEnv:
    """Resolves coordinator, world size and rank from arguments and launcher environment.

    Explicit arguments win, field by field: a setting passed as an argument is taken as it is
    and the variables it replaces are not read, so a partial, stray or malformed launcher
    variable never blocks it (``RANK`` set without ``WORLD_SIZE`` is no error when
    ``num_processes`` is passed). Only settings left open are read from the environment, and
    only a setting that is needed and missing is an error.

    The launcher is the first of these whose variables are set (the innermost one when launchers
    are nested, see :func:`detect_launcher`):

    1. torchrun / DeepSpeed / ``jaxcomm launch`` (``WORLD_SIZE`` set, or ``RANK`` set without
          ``duplex.sh``'s variables): ``RANK``, ``WORLD_SIZE``, coordinator ``MASTER_ADDR`` +
          ``MASTER_PORT``, optional ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.
    2. ``duplex.sh``, the two-host emulation on one machine (``COORD`` and ``NPROC`` set):
          ``RANK``, ``NPROC``, coordinator ``COORD`` (``host:port``). Each rank is its own
          emulated node; no local rank.
    3. Open MPI (``OMPI_COMM_WORLD_RANK`` or ``OMPI_COMM_WORLD_SIZE`` set):
          ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
          ``OMPI_COMM_WORLD_LOCAL_SIZE``; the coordinator from ``MASTER_ADDR``/``MASTER_PORT``,
          or (under ``mpirun`` of Open MPI 4, which sets ``OMPI_MCA_orte_hnp_uri``) from JAX's
          own Open MPI detection.
    4. None of these: rank and size stay ``None`` (the coordinator may still come from
          ``JAXCOMM_COORDINATOR`` or ``MASTER_ADDR``/``MASTER_PORT``);
          :func:`jaxcomm.init_distributed` then reads SLURM's variables, and
          ``jax.distributed.initialize()`` detects anything else (TPU, Kubernetes, ...).

    So under ``srun torchrun`` torchrun's variables win over SLURM's, and ``srun duplex.sh``
    gives ``duplex.sh``'s. The coordinator is, in order: ``coordinator_address``,
    ``JAXCOMM_COORDINATOR=host:port``, the launcher's own (``COORD`` for ``duplex.sh``),
    ``MASTER_ADDR:MASTER_PORT``.

    Args:
        env: Environment mapping; defaults to ``os.environ``.
        coordinator_address: Explicit ``host:port``; overrides the environment.
        num_processes: Explicit number of processes; overrides the environment.
        process_id: Explicit rank; overrides the environment.

    Returns:
        The resolved :class:`DistributedEnv`; ``source`` is ``"arguments"`` when all three
        were passed, else the launcher read (``"torchrun"``, ``"duplex"``, ``"ompi"``) or
        ``"jax"``.

    Raises:
        ValueError: Bad arguments, or a setting left to the environment that a launcher's
            variables leave missing, non-integer or inconsistent. The message names the variable.
    """
    env = os.environ if env is None else env

    coord = coordinator_address
    if coord is not None:
        coord = _check_address(coord, "coordinator_address")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1.")
    if process_id is not None and process_id < 0:
        raise ValueError(f"process_id={process_id} must be >= 0.")

    launcher = detect_launcher(env)
    rank, rank_from = process_id, "process_id"
    size, size_from = num_processes, "num_processes"
    local_rank: int | None = None
    local_size: int | None = None
    if launcher is not None:
        if rank is None:
            rank, rank_from = parse_int(env, launcher.rank), launcher.rank
            if rank is None:
                raise ValueError(
                    f"{_seen(env, launcher)} set but {launcher.rank} is missing "
                    "(or pass process_id)."
                )
        if size is None:
            size, size_from = parse_int(env, launcher.size, minimum=1), launcher.size
            if size is None:
                raise ValueError(
                    f"{_seen(env, launcher)} set but {launcher.size} is missing "
                    "(or pass num_processes)."
                )
        if launcher.local_rank is not None:
            local_rank = parse_int(env, launcher.local_rank)
        if launcher.local_size is not None:
            local_size = parse_int(env, launcher.local_size, minimum=1)
    if rank is not None and size is not None and rank >= size:
        raise ValueError(f"{rank_from}={rank} must be smaller than {size_from}={size}.")
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ValueError(f"local rank {local_rank} must be smaller than local size {local_size}.")

    if coord is None:
        coord = _coordinator_from_env(env, launcher)
    if coord is None and launcher is TORCHRUN:
        raise ValueError(
            f"{_seen(env, launcher)} set but MASTER_ADDR and MASTER_PORT are missing "
            f"(or set {COORDINATOR_ENV}=host:port, or pass coordinator_address)."
        )
    if coord is None and launcher is OMPI and "OMPI_MCA_orte_hnp_uri" not in env:
        # Without the ORTE URI, JAX's Open MPI detection cannot derive it either.
        raise ValueError(
            f"{_seen(env, launcher)} set but no coordinator is known: set "
            f"{COORDINATOR_ENV}=host:port or MASTER_ADDR and MASTER_PORT, or pass "
            "coordinator_address."
        )

    if None not in (coordinator_address, num_processes, process_id):
        source = "arguments"
    else:
        source = "jax" if launcher is None else launcher.name
    return DistributedEnv(
        coordinator_address=coord,
        num_processes=size,
        process_id=rank,
        local_rank=local_rank,
        local_world_size=local_size,
        source=source,
    )
