"""Which process am I: coordinator, world size and rank from a launcher's environment (pure).

:func:`resolve_distributed_env` reads what torchrun / DeepSpeed (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), Open MPI (``OMPI_COMM_WORLD_*``) or
``jaxcomm launch`` (``JAXCOMM_COORDINATOR``) set, with explicit arguments winning, and checks it,
without starting anything, so it is unit-tested on plain dicts.
:func:`jaxcomm.init_distributed` then starts ``jax.distributed`` with the result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

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
        rank, size = rank_and_size(env, "RANK", "WORLD_SIZE")
        local_rank = parse_int(env, "LOCAL_RANK")
        local_size = parse_int(env, "LOCAL_WORLD_SIZE", minimum=1)
        if env_coord is None and coordinator_address is None:
            raise ValueError(
                "RANK/WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are missing "
                f"(or set {COORDINATOR_ENV}=host:port)."
            )
        source = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        rank, size = rank_and_size(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local_rank = parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = parse_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
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
