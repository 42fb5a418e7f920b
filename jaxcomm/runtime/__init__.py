"""Runtime set-up: what a process does before (or instead of) its first JAX computation.

``distributed`` (:func:`init_distributed`: backend choice, ``jax.distributed``, heartbeats),
``environment`` (:func:`resolve_distributed_env`: coordinator, size and rank from a launcher's
environment, pure), ``host_allocator`` (glibc settings that keep XLA:CPU's step buffers
mapped) and ``overlap_flags`` (``XLA_FLAGS`` presets that let communication overlap compute).
Public names are also exported from :mod:`jaxcomm`.
"""

from jaxcomm.runtime.distributed import BACKENDS as BACKENDS
from jaxcomm.runtime.distributed import DistributedInfo as DistributedInfo
from jaxcomm.runtime.distributed import backends_initialized as backends_initialized
from jaxcomm.runtime.distributed import init_distributed as init_distributed
from jaxcomm.runtime.environment import DistributedEnv as DistributedEnv
from jaxcomm.runtime.environment import resolve_distributed_env as resolve_distributed_env
from jaxcomm.runtime.host_allocator import configure_host_allocator as configure_host_allocator
from jaxcomm.runtime.overlap_flags import FLAG_DOCS as FLAG_DOCS
from jaxcomm.runtime.overlap_flags import merge_flags as merge_flags
from jaxcomm.runtime.overlap_flags import set_xla_flags as set_xla_flags
from jaxcomm.runtime.overlap_flags import xla_flags as xla_flags
