"""Host allocator settings that keep XLA:CPU's step buffers mapped between steps (glibc).

An XLA:CPU step allocates its temporaries and outputs with ``malloc`` every time it runs. glibc
serves a request above its mmap threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and
returns it to the kernel on ``free``, and each thread's arena is trimmed back when its top is
free: the next step touches brand-new pages and pays a page fault per 4 KiB. A train step
allocates hundreds of MiB this way, so its element-wise passes run at a fraction of the memory
bandwidth (a compressed step, with more passes per parameter than Adam's, loses most).

:func:`configure_host_allocator` makes every thread allocate from glibc's main heap
(``M_ARENA_MAX=1``), serves large blocks from that heap instead of ``mmap``
(``M_MMAP_THRESHOLD``) and never gives freed memory back to the kernel (``M_TRIM_THRESHOLD``,
``M_TOP_PAD``): from the second step on, every buffer a step needs is already mapped.

The cost: the process's resident memory stays at its peak heap (freed memory is kept for the
next step, which is what a training loop wants) and small allocations of all threads share one
arena lock. The settings are process-wide and only take effect before JAX starts its threads: call
it first, before any JAX computation.

It is the default: ``import jaxcomm`` applies it when JAX will run on the CPU (``JAX_PLATFORMS``
names ``cpu`` first, or no GPU/TPU plugin is installed), so a CPU training script gets it without
a call. Set ``JAXCOMM_HOST_ALLOCATOR=0`` in the environment to opt out (``=1`` applies it on any
platform). :func:`jaxcomm.init_distributed` applies it for gloo/mpi collectives
(``host_allocator=False`` opts out there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

#: What :func:`configure_host_allocator` sets: ``(mallopt parameter, name, value)``.
SETTINGS = (
    (_M_ARENA_MAX, "M_ARENA_MAX", 1),
    (_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", _INT_MAX),
    (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", _INT_MAX),
    (_M_TOP_PAD, "M_TOP_PAD", 256 << 20),
)

_applied = False


def _mallopt():
    """glibc's ``mallopt``, or ``None`` (another C library, or no C library to load)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        fn = libc.mallopt
        # gnu_get_libc_version exists only in glibc: musl's mallopt is a no-op stub.
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def configure_host_allocator() -> bool:
    """Keep the buffers of XLA:CPU steps mapped between steps (see the module docstring).

    Sets glibc's ``M_ARENA_MAX=1``, ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to their
    largest value and ``M_TOP_PAD`` to 256 MiB, once per process. Call it before any JAX
    computation (threads that already allocated keep their arenas: measured, no effect then).

    Returns:
      ``True`` if the settings are in place (now or by an earlier call), ``False`` where the C
      library is not glibc (nothing is changed).

    Examples:
      Call it first thing in a CPU training script (here only the settings are listed, since
      calling it changes the whole process):

      >>> from jaxcomm.runtime.host_allocator import SETTINGS
      >>> [name for _, name, _ in SETTINGS]
      ['M_ARENA_MAX', 'M_MMAP_THRESHOLD', 'M_TRIM_THRESHOLD', 'M_TOP_PAD']
    """
    global _applied
    if _applied:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        logger.info("configure_host_allocator: not glibc, nothing changed")
        return False
    for param, name, value in SETTINGS:
        if mallopt(param, value) != 1:  # pragma: no cover (glibc accepts all four)
            logger.warning("configure_host_allocator: mallopt(%s, %d) refused", name, value)
            return False
    _applied = True
    return True


#: Environment variable: ``0``/``false``/``off`` opts out of the import-time default, ``1``/
#: ``true``/``on`` applies it whatever the platform.
ENV_VAR = "JAXCOMM_HOST_ALLOCATOR"


def _accelerator_plugin_installed() -> bool:
    """Whether a JAX GPU or TPU plugin is installed (JAX would then not default to the CPU)."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    try:
        return any(True for _ in importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # pragma: no cover (a broken distribution's metadata)
        return False


def default_wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether the import-time default applies: the opt-out, else JAX's CPU backend expected.

    ``JAXCOMM_HOST_ALLOCATOR`` decides when set; otherwise ``JAX_PLATFORMS`` (its first entry
    ``cpu``), otherwise whether no GPU/TPU plugin is installed.
    """
    env = os.environ if environ is None else environ
    setting = env.get(ENV_VAR, "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    if setting in ("1", "true", "on", "yes"):
        return True
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not _accelerator_plugin_installed()


def apply_default() -> bool:
    """Apply :func:`configure_host_allocator` if :func:`default_wanted` (``import jaxcomm``)."""
    return configure_host_allocator() if default_wanted() else False
