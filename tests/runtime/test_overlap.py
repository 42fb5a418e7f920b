"""XLA flag presets: every flag is one the installed XLA accepts; merging keeps user flags."""

import os
import shlex
import subprocess
import sys

import pytest

import jaxcomm as jc
from jaxcomm.runtime import FLAG_DOCS, merge_flags, set_xla_flags


def _names(flags: str) -> list[str]:
    return [tok.lstrip("-").split("=", 1)[0] for tok in shlex.split(flags)]


def test_gpu_preset_contents():
    flags = jc.xla_flags("gpu", combine_threshold_bytes=1 << 20, base="")
    values = dict(tok.lstrip("-").split("=", 1) for tok in shlex.split(flags))
    assert values["xla_gpu_enable_latency_hiding_scheduler"] == "true"
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert values[f"xla_gpu_enable_pipelined_{op}"] == "true"
        assert values[f"xla_gpu_{op}_combine_threshold_bytes"] == str(1 << 20)
    assert values["xla_gpu_enable_reassociation_for_converted_ar"] == "false"
    assert set(values) <= set(FLAG_DOCS)  # every emitted flag is documented
    off = jc.xla_flags("gpu", latency_hiding=False, keep_payload_dtype=False, base="")
    values = dict(tok.lstrip("-").split("=", 1) for tok in shlex.split(off))
    assert values["xla_gpu_enable_latency_hiding_scheduler"] == "false"
    assert values["xla_gpu_enable_reassociation_for_converted_ar"] == "true"
    assert not any("combine_threshold" in k for k in values)  # None: XLA's default


def test_merge_replaces_same_named_flags_and_keeps_others():
    base = "--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=false"
    merged = jc.xla_flags("gpu", base=base)
    names = _names(merged)
    assert names[0] == "xla_dump_to" and names.count("xla_gpu_enable_latency_hiding_scheduler") == 1
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in merged
    assert jc.xla_flags("cpu", base=base) == merge_flags(base, {}) == base  # nothing on CPU


def test_bad_arguments(monkeypatch):
    import jax

    jax.devices()  # make sure the backend exists
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the test
    with pytest.raises(ValueError, match="platform"):
        jc.xla_flags("tpuv9")
    with pytest.raises(ValueError, match="combine_threshold_bytes"):
        jc.xla_flags("gpu", combine_threshold_bytes=-1)
    with pytest.raises(RuntimeError, match="already initialized"):
        set_xla_flags("gpu")  # the test session's backend exists: the flags would be ignored


def test_installed_xla_accepts_every_preset_flag():
    """XLA aborts on unknown XLA_FLAGS; a CPU jaxlib parses the GPU debug options too."""
    flags = jc.xla_flags("gpu", combine_threshold_bytes=1 << 20, base="")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    code = "import jax; print(jax.numpy.ones(3).sum())"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "3.0", proc.stderr[-2000:]
    # The check can fail: a misspelled flag is fatal.
    env["XLA_FLAGS"] = flags + " --xla_gpu_enable_latency_hiding_schedulr=true"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "Unknown flag" in proc.stderr


def test_tpu_preset_goes_to_libtpu_init_args(monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_all_to_all=false --keep=1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    flags = jc.xla_flags("tpu")  # starts from LIBTPU_INIT_ARGS, not XLA_FLAGS
    assert flags == "--keep=1 --xla_tpu_enable_async_all_to_all=true"
    assert set(_names(flags)) - {"keep"} <= set(FLAG_DOCS)
    off = jc.xla_flags("tpu", latency_hiding=False, base="")
    assert off == "--xla_tpu_enable_async_all_to_all=false"
