"""XLA flag presets that let communication overlap computation (GPU, TPU).

jaxcomm splits a tree into buckets whose collective chains share no data (see
``bucket_bytes``), so while one bucket's compressed payload is on the wire, the next bucket can
be compressed, and the backward pass of a training step can keep running. Whether XLA actually
overlaps them is a scheduler decision, controlled by flags that must be set (in ``XLA_FLAGS``)
before the backend starts:

``--xla_gpu_enable_latency_hiding_scheduler=true``
    Schedules async collectives early and their ``-done`` late, with compute in between, using
    a cost model of both.
``--xla_gpu_enable_pipelined_{all_reduce,all_gather,reduce_scatter}=true``
    In loops (scan over layers, microbatches), moves iteration i's collective across the loop
    boundary so that it overlaps iteration i+1's compute.
``--xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes=B``
    Largest collective XLA's combiner may build by merging small ones. Set it to
    ``bucket_bytes`` (or less) so that XLA does not fuse jaxcomm's buckets back into one
    collective that cannot overlap anything.
``--xla_gpu_enable_reassociation_for_converted_ar=false``
    ``true`` (XLA's default) lets XLA move a convert across an all-reduce, which turns a bf16
    all-reduce into an f32 one (twice the bytes); ``false`` keeps the dtype the program asked
    for. :func:`jaxcomm.comms_report` flags such widened collectives.
``--xla_gpu_enable_highest_priority_async_stream=true``
    Runs collectives on a high-priority stream so that compute kernels do not starve them.

On TPU the flags go in ``LIBTPU_INIT_ARGS`` (``set_xla_flags("tpu")`` writes them there):

``--xla_tpu_enable_async_all_to_all=true``
    Compiles each all-to-all (OneBit's and the quantizers' worker stage) as an async start/done
    pair that the scheduler overlaps with compute; without it XLA:TPU keeps them synchronous
    (read from programs compiled for v5e and v5p with ``benchmarks/aot_report.py``). The flag
    is the one JAX's own async-collective tests pass as a compiler option.

No flag is needed, or known, for the all-gathers: XLA:TPU runs an all-gather asynchronously as
an *async collective fusion* (on by default; MaxText's ``CF_FOR_ALL_GATHER`` in
``benchmarks/xla_flags_library.py`` only makes sure of it), carried by an independent matmul
running beside it. Next to elementwise work only (a compressor's server stage after the
backward pass) it stays synchronous whatever the scheduler flags, e.g.
``xla_tpu_enable_all_experimental_scheduler_features`` or
``xla_lhs_prioritize_async_depth_over_stall`` (described in AXLearn's
``axlearn/common/compiler_options.py``).

On CPU, XLA runs collectives synchronously: there is nothing to overlap and
``xla_flags("cpu")`` adds no flag.

Sources: the GPU flags and their defaults are defined in XLA's ``xla/debug_options_flags.cc``.
The latency-hiding scheduler and the pipelined collectives are the passes XLA's GPU
optimization level ``O1`` turns on (https://openxla.org/xla/gpu_optimization_levels); the
scheduler is also JAX's advice (https://docs.jax.dev/en/latest/gpu_performance_tips.html), and
the combine thresholds are NVIDIA's advice for many small collectives
(https://docs.nvidia.com/jax-toolbox/performance-profiling/gpu-performance). The TPU flag is
the compiler option JAX's async-collective tests pass; XLA's flag guide
(https://openxla.org/xla/flags_guidance) lists the TPU flags for async all-gather.

Usage (before ``import jax`` creates a backend)::

    import os, jaxcomm as jc
    os.environ["XLA_FLAGS"] = jc.xla_flags("gpu", combine_threshold_bytes=32 << 20)
"""

from __future__ import annotations

import os
import shlex

#: Every flag the presets may emit, with what it does (for docs and ``--help`` texts).
FLAG_DOCS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": (
        "schedule async collectives early and their completion late, with compute between"
    ),
    "xla_gpu_enable_pipelined_all_reduce": "overlap a loop iteration's all-reduce with the next",
    "xla_gpu_enable_pipelined_all_gather": "overlap a loop iteration's all-gather with the next",
    "xla_gpu_enable_pipelined_reduce_scatter": (
        "overlap a loop iteration's reduce-scatter with the next"
    ),
    "xla_gpu_all_reduce_combine_threshold_bytes": "largest all-reduce XLA's combiner may build",
    "xla_gpu_all_gather_combine_threshold_bytes": "largest all-gather XLA's combiner may build",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": (
        "largest reduce-scatter XLA's combiner may build"
    ),
    "xla_gpu_enable_reassociation_for_converted_ar": (
        "let XLA widen a converted all-reduce (bf16 -> f32); false keeps the requested dtype"
    ),
    "xla_gpu_enable_highest_priority_async_stream": "run collectives on a high-priority stream",
    "xla_tpu_enable_async_all_to_all": "compile all-to-all as an async pair the scheduler overlaps",
}

#: The environment variable each platform's compiler reads its flags from.
FLAGS_ENV = {"gpu": "XLA_FLAGS", "cpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}
_PLATFORMS = tuple(FLAGS_ENV)


def _bool(v: bool) -> str:
    return "true" if v else "false"


def xla_flags(
    platform: str = "gpu",
    *,
    latency_hiding: bool = True,
    pipelined: bool = True,
    combine_threshold_bytes: int | None = None,
    keep_payload_dtype: bool = True,
    priority_stream: bool = True,
    base: str | None = None,
) -> str:
    """Flags that let jaxcomm's bucketed collectives overlap compute on ``platform``.

    Args:
      platform: ``"gpu"`` (for ``XLA_FLAGS``), ``"tpu"`` (for ``LIBTPU_INIT_ARGS``), or
        ``"cpu"`` (no overlap flags: XLA's CPU collectives are synchronous).
      latency_hiding: enable the latency-hiding scheduler (GPU); async all-to-all (TPU).
      pipelined: pipeline all-reduce, all-gather and reduce-scatter across loop iterations.
      combine_threshold_bytes: cap for XLA's collective combiners; pass your ``bucket_bytes``
        (or less) so XLA keeps the buckets separate. ``None`` leaves XLA's default.
      keep_payload_dtype: turn off XLA's reassociation of converted all-reduces, which widens
        a bf16 all-reduce to f32.
      priority_stream: give collectives the highest-priority stream.
      base: flags to start from (default: the platform's variable, :data:`FLAGS_ENV`); the
        preset's flags replace same-named ones, the rest are kept.

    Returns:
      A space-separated flag string for ``FLAGS_ENV[platform]``.
    """
    if platform not in _PLATFORMS:
        raise ValueError(
            f"jaxcomm.xla_flags: platform must be one of {_PLATFORMS}, got {platform!r}"
        )
    if combine_threshold_bytes is not None and (
        not isinstance(combine_threshold_bytes, int) or combine_threshold_bytes < 0
    ):
        raise ValueError(
            f"jaxcomm.xla_flags: combine_threshold_bytes must be an int >= 0, "
            f"got {combine_threshold_bytes!r}"
        )
    flags: dict[str, str] = {}
    if platform == "gpu":
        flags["xla_gpu_enable_latency_hiding_scheduler"] = _bool(latency_hiding)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            flags[f"xla_gpu_enable_pipelined_{op}"] = _bool(pipelined)
            if combine_threshold_bytes is not None:
                flags[f"xla_gpu_{op}_combine_threshold_bytes"] = str(combine_threshold_bytes)
        flags["xla_gpu_enable_reassociation_for_converted_ar"] = _bool(not keep_payload_dtype)
        flags["xla_gpu_enable_highest_priority_async_stream"] = _bool(priority_stream)
    elif platform == "tpu":
        flags["xla_tpu_enable_async_all_to_all"] = _bool(latency_hiding)
    env = os.environ.get(FLAGS_ENV[platform], "")
    return merge_flags(env if base is None else base, flags)


def merge_flags(base: str, flags: dict[str, str]) -> str:
    """``base`` flags with ``flags`` (name -> value) replacing same-named ones, in order."""
    kept = [tok for tok in shlex.split(base) if tok.lstrip("-").split("=", 1)[0] not in flags]
    return " ".join(kept + [f"--{k}={v}" for k, v in flags.items()])


def set_xla_flags(platform: str = "gpu", **kwargs) -> str:
    """Writes :func:`xla_flags` into the platform's variable (``XLA_FLAGS``, or
    ``LIBTPU_INIT_ARGS`` on TPU) and returns it.

    Raises:
      RuntimeError: a JAX backend already exists, so the flags would be ignored.
    """
    from jaxcomm._compat import backends_initialized

    if backends_initialized():
        raise RuntimeError(
            "jaxcomm.set_xla_flags: a JAX backend is already initialized; XLA reads XLA_FLAGS "
            "once. Call this before the first jax computation (or set XLA_FLAGS in the shell)."
        )
    name = FLAGS_ENV.get(platform, "XLA_FLAGS")
    os.environ[name] = xla_flags(platform, **kwargs)
    return os.environ[name]
