"""jc.configure_host_allocator: large buffers come from glibc's heap and stay mapped after free.

Each case runs in a fresh Python process (the settings are process-wide and only apply before
threads allocate) and reads glibc's own accounting, ``mallinfo2()``: the growth of ``hblkhd``
(memory in ``mmap``-ed blocks, which a step would page-fault into afresh) over one allocation,
and ``arena`` (the heap's size). Without the settings a 64 MiB array is an ``mmap``-ed block;
with them it is in the heap, and the heap keeps its pages after the array is freed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

MIB = 1 << 20

PROBE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    MODE = sys.argv[1]
    class MallInfo2(ctypes.Structure):
        _fields_ = [(k, ctypes.c_size_t) for k in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    if MODE == "import":
        import jaxcomm
    elif MODE == "configure":
        import jaxcomm as jc
        assert jc.configure_host_allocator() is True
        assert jc.configure_host_allocator() is True  # idempotent
    elif MODE.startswith("init_distributed"):
        import jaxcomm as jc
        kw = {} if MODE == "init_distributed" else {"host_allocator": False}
        jc.init_distributed("gloo", coordinator_address="127.0.0.1:" + sys.argv[2],
                            num_processes=1, process_id=0, **kw)
    import numpy as np
    before = libc.mallinfo2()
    x = np.ones(64 << 18, np.float32)  # 64 MiB
    alive = libc.mallinfo2()
    del x
    freed = libc.mallinfo2()
    print(json.dumps({"alive_mmapped": alive.hblkhd - before.hblkhd,
                      "alive_heap": alive.arena, "freed_heap": freed.arena}))
    """
)


def _glibc_with_mallinfo2() -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018
        libc.mallinfo2  # noqa: B018
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


pytestmark = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33")


def _probe(mode: str, *extra: str, **set_env: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("JAXCOMM_HOST_ALLOCATOR", None)
    env.update(set_env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_default_glibc_maps_a_large_buffer_afresh():
    # The control: what XLA:CPU's step buffers get without the settings.
    info = _probe("default")
    assert info["alive_mmapped"] >= 64 * MIB


def test_configured_heap_serves_and_keeps_a_large_buffer():
    info = _probe("configure")
    assert info["alive_mmapped"] < MIB
    assert info["alive_heap"] >= 64 * MIB
    assert info["freed_heap"] >= 64 * MIB  # not trimmed back to the kernel


def test_init_distributed_configures_it_for_cpu_backends_unless_told_not_to():
    on = _probe("init_distributed", _free_port())
    assert on["alive_mmapped"] < MIB and on["freed_heap"] >= 64 * MIB
    off = _probe("init_distributed_off", _free_port(), JAXCOMM_HOST_ALLOCATOR="0")
    assert off["alive_mmapped"] >= 64 * MIB


def test_import_applies_it_on_cpu_unless_opted_out():
    on = _probe("import", JAX_PLATFORMS="cpu")
    assert on["alive_mmapped"] < MIB and on["freed_heap"] >= 64 * MIB
    off = _probe("import", JAX_PLATFORMS="cpu", JAXCOMM_HOST_ALLOCATOR="0")
    assert off["alive_mmapped"] >= 64 * MIB
    # An accelerator named first: left to the user (the heap settings are for XLA:CPU).
    gpu = _probe("import", JAX_PLATFORMS="cuda,cpu")
    assert gpu["alive_mmapped"] >= 64 * MIB
    forced = _probe("import", JAX_PLATFORMS="cuda,cpu", JAXCOMM_HOST_ALLOCATOR="1")
    assert forced["alive_mmapped"] < MIB


def test_default_wanted_reads_the_environment():
    from jaxcomm.runtime.host_allocator import default_wanted

    assert default_wanted({"JAX_PLATFORMS": "cpu"})
    assert not default_wanted({"JAX_PLATFORMS": "tpu"})
    assert not default_wanted({"JAX_PLATFORMS": "cpu", "JAXCOMM_HOST_ALLOCATOR": "off"})
    assert default_wanted({"JAX_PLATFORMS": "tpu", "JAXCOMM_HOST_ALLOCATOR": "on"})

