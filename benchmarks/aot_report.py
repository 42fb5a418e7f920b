"""Compile jaxcomm's train steps for TPU on a machine without one: memory, collectives, overlap.

Each method's ``jc.make_train_step`` program (the phase that communicates, e.g. 1-bit Adam
after its freeze) is compiled ahead of time for TPU topologies given by
``jax.experimental.topologies`` (no TPU attached: only libtpu's compiler runs), on a GPT-2
small sized transformer (about 125M parameters by default), bucketed with ``--bucket-bytes``.
For every compile it records:

* whether it compiles (or the error), compile seconds, peak memory per device
  (``compiled.memory_analysis()``), and the bytes accessed per device by XLA's own cost
  analysis (``compiled.cost_analysis()``; where the compiled program exposes none, XLA:GPU
  compiled without a GPU, the same count from its HLO text by ``benchmarks/hlo_bytes.py``);
* every collective of the compiled HLO (``jaxcomm.inspect.collectives_in_hlo``): kind, dtype,
  bytes each device sends (ring/pairwise model, see ``jaxcomm.inspect``), and the same bytes
  as laid out in the layout's tiles (``tiled_wire_bytes``: on TPU a uint8 ``(1, R)`` row fills
  4 tile rows, 4x its bytes, as the all-gather emitter's ``shard_size`` shows);
* whether it is asynchronous (a start/done pair, an ``async-start``/``async-done`` around it,
  or XLA:TPU's async collective fusion: an ``async-collective-start`` fusion, compute fusions
  that carry its state, an ``async-collective-done``) and how many compute instructions the
  scheduler placed between its start and its done.
  The *overlap fraction* is the share of collective bytes with at least one compute
  instruction scheduled in that window. It is read from the compiled schedule, not timed;
* on a multislice topology, whether each collective's device groups span more than one slice
  (``device.slice_index``): those bytes cross the data-centre network;
* on a topology of several hosts or slices, ``levels``: the bytes each device sends across the
  slow link and the bytes that stay inside its node, against the tuple axis's target
  (:func:`level_bytes`).

``--axes flat,tuple``: ``flat`` compiles each method over one axis ``"dp"`` of every device;
``tuple`` (topologies of several nodes only) over ``("host", "local")`` on a ``(nodes,
devices per node)`` mesh, slowest first: the gradient is reduced exactly inside a node and only
each device's ``1/n_fast`` share is compressed across nodes. Target of a tuple row: at most
``1.3 x (2 P bits / 8) / n_fast`` bytes per device across nodes, plus a few kB of scalars
(``BOUND_FACTOR``, ``SCALAR_SLACK``); DiLoCo's inner step nothing beyond scalars.

``--flags default,async`` compiles each step twice: with libtpu's defaults and with the flags
that make collectives asynchronous (``TPU_ASYNC_FLAGS`` below, passed as per-program
``compiler_options``, the same settings ``LIBTPU_INIT_ARGS`` takes).

Phases: the steps are phase-specialised (one program per phase of the optimizer's schedule).
Which phase values a given step count runs is read by running the same optimizer, with the
same schedule, on a tiny copy of the model on CPU devices; the full-size program is then
compiled for those values only.

Needs ``jax[tpu]`` (libtpu) next to jaxcomm, e.g. in a separate venv::

    python3 -m venv /tmp/tpu-venv && /tmp/tpu-venv/bin/pip install "jax[tpu]==0.10.2" optax
    /tmp/tpu-venv/bin/pip install --no-deps -e .
    /tmp/tpu-venv/bin/python benchmarks/aot_report.py [--topologies v5e:2x2,v5p:2x2x1,v5e:2x2x2s]
        [--methods adam,onebit_mean,onebit_adam,zero_one_adam,diloco_int4,sharded_int8]
        [--axes flat,tuple] [--layers 12] [--flags default,async] [--out DIR] [--json OUT]

and, for the H100 topologies (``h100:2x1x8``: 2 hosts of 8), ``jax[cuda12]`` in another venv
(``pip install "jax[cuda12]==0.10.2" optax``; no GPU or driver needed), with the H100
``GpuTargetConfig`` at ``JAXCOMM_H100_TARGET_CONFIG`` (default ``../shared/reference/``).

``v5e:2x2x2s`` means two slices of ``v5e:2x2`` (``num_slices=2``). The JSON (command, versions,
machine, date, commit, every row) and each compiled HLO go into ``--out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "16")  # the phase probe of 2 x 8 GPUs
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling needs no exclusive TPU
# jax[cuda12] without a driver: without this the CUDA plugin does not register (no H100 topology).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from importlib import metadata  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from hlo_bytes import hlo_bytes_accessed  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# The model: a GPT-2 style decoder, layers unrolled (shared with the other step benchmarks).
from step_models import ModelConfig, cpu_model, make_loss  # noqa: E402

import jaxcomm as jc  # noqa: E402
from jaxcomm.comm.axes import AxisName  # noqa: E402
from jaxcomm.inspect import DTYPE_BYTES, collectives_in_hlo, num_devices, replica_groups  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Flags. Sources (read in the repositories, see the report):
#   AI-Hypercomputer/maxtext benchmarks/xla_flags_library.py, CF_FOR_ALL_GATHER and
#     CF_FOR_ALL_REDUCE ("continuation fusion": async collectives overlapped with compute);
#   jax-ml/jax's async-collective tests (jax.jit(compiler_options={
#     'xla_tpu_enable_async_all_to_all': 'true'}) for an async all-to-all on TPU), and the
#     same flag in TPU recipe scripts next to the MaxText ones.
TPU_ASYNC_FLAGS: dict[str, str] = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
    "xla_enable_async_all_reduce": "true",
    "xla_tpu_enable_async_all_to_all": "true",
}
# MaxText scripts/diloco/run_diloco.sh adds this one: keep an all-gather an (async) all-gather
# instead of rewriting it as an all-reduce (which XLA:TPU does to OneBit's server stage).
FLAG_SETS: dict[str, dict[str, str]] = {
    "default": {},
    "async": TPU_ASYNC_FLAGS,
    "async_ag": {**TPU_ASYNC_FLAGS, "xla_tpu_prefer_async_allgather_to_allreduce": "true"},
}


def flag_set(platform: str, name: str, bucket_bytes: int | None) -> dict:
    """Compiler options of flag set ``name``: on GPU, ``async`` is ``jc.xla_flags("gpu")``
    with the combine thresholds at the bucket size (the flags ``XLA_FLAGS`` would carry)."""
    if platform == "tpu" or name == "default":
        return dict(FLAG_SETS[name])
    text = jc.xla_flags("gpu", combine_threshold_bytes=bucket_bytes, base="")
    typed = {"true": True, "false": False}  # XLA:GPU's options want typed values, not strings
    pairs = (tok.lstrip("-").split("=", 1) for tok in text.split())
    return {k: typed.get(v, int(v) if v.isdigit() else v) for k, v in pairs}


# ---------------------------------------------------------------------------------------------
# The methods, as a user would write them. Each gives the optimizer and the step counts whose
# programs are compiled (a short schedule, so the phases are reached in a few tiny CPU steps;
# the compiled program of a phase does not depend on the count).


# Extra optimizer arguments of the rows with a skip cap (none: the defaults; on GPU
# make_train_step checks the cap on the host, so no host callback needs a GPU to compile).
SKIPS: dict = {}

# The two-level axis, slowest first: one row of the mesh per node (GPU host or TPU slice).
TUPLE = ("host", "local")


@dataclass(frozen=True)
class Method:
    name: str
    what: str
    make: Callable[[int | None, AxisName], optax.GradientTransformation]  # (bucket, axis) -> tx
    counts: dict[str, int]  # label -> step count whose phase is compiled
    # Bits per parameter the method's compressor sends across the slow axis (the two-level
    # bound, see level_bytes), or a function of the model for DeMo's message; None: no bound.
    bits: float | Callable[[ModelConfig], float] | None = None
    silent: tuple[str, ...] = ()  # phases that should send nothing across the slow axis


def methods() -> dict[str, Method]:
    """The methods by name. ``make(bucket_bytes, axis)`` builds the optimizer over ``axis``:
    ``"dp"`` (one flat axis) or ``TUPLE`` (``("host", "local")``, slowest first)."""
    ms = [
        Method(
            "adam", "exact mean + Adam",
            lambda b, ax: optax.chain(
                jc.compressed_mean(ax, jc.NoCompression(), b), optax.adam(1e-3)
            ),
            {"step": 0}, bits=32,
        ),
        Method(
            "onebit_mean", "compressed_mean(OneBit) + Adam",
            lambda b, ax: optax.chain(
                jc.compressed_mean(ax, jc.OneBit(), b, warmup_steps=2), optax.adam(1e-3)
            ),
            {"compressed": 3}, bits=1,
        ),
        Method(
            "int8ef_mean", "compressed_mean(int8 + EF) + Adam",
            lambda b, ax: optax.chain(
                jc.compressed_mean(
                    ax, jc.Quantize(bits=8, error_feedback=True), b, warmup_steps=2
                ),
                optax.adam(1e-3),
            ),
            {"compressed": 3}, bits=8,
        ),
        Method(
            "int4ef_mean", "compressed_mean(int4 + EF) + Adam",
            lambda b, ax: optax.chain(
                jc.compressed_mean(
                    ax, jc.Quantize(bits=4, error_feedback=True), b, warmup_steps=2
                ),
                optax.adam(1e-3),
            ),
            {"compressed": 3}, bits=4,
        ),
        Method(
            "onebit_adam", "1-bit Adam (after the freeze)",
            lambda b, ax: jc.onebit_adam(
                1e-3, freeze_step=2, axis_name=ax, bucket_bytes=b, **SKIPS
            ),
            {"compressed": 4}, bits=1,
        ),
        Method(
            "zero_one_adam", "0/1 Adam (1-bit step; sync after the freeze)",
            lambda b, ax: jc.zero_one_adam(
                1e-3, var_freeze_step=4, var_update_scaler=1, local_step_scaler=1,
                axis_name=ax, bucket_bytes=b, **SKIPS,
            ),
            {"onebit": 2, "sync": 5}, bits=1,
        ),
        Method(
            "onebit_lamb", "1-bit LAMB (after the freeze)",
            lambda b, ax: jc.onebit_lamb(
                1e-3, freeze_step=2, axis_name=ax, bucket_bytes=b, **SKIPS
            ),
            {"compressed": 4}, bits=1,
        ),
        Method(
            "demo", "DeMo (top_k=32 of 64x64 chunks, fp32 values)",
            lambda b, ax: jc.demo(3e-3, axis_name=ax, **SKIPS),
            {"step": 0}, bits=demo_bits,
        ),
        Method(
            "diloco_int4", "DiLoCo H=4, int4 + EF outer gradients (sync step)",
            lambda b, ax: jc.diloco(
                optax.adam(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True), 4, ax,
                compressor=jc.Quantize(bits=4, error_feedback=True), bucket_bytes=b, **SKIPS,
            ),
            {"sync": 3}, bits=4,
        ),
        Method(
            "diloco_inner", "DiLoCo H=4, int4 + EF outer gradients (inner step)",
            lambda b, ax: jc.diloco(
                optax.adam(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True), 4, ax,
                compressor=jc.Quantize(bits=4, error_feedback=True), bucket_bytes=b, **SKIPS,
            ),
            {"inner": 1}, bits=0, silent=("inner",),
        ),
        Method(
            "sharded_int8", "jc.sharded Adam, int8 grads + int8 weights",
            lambda b, ax: jc.sharded(
                optax.adam(1e-3), ax, compressor=jc.Quantize(bits=8),
                gather_compressor=jc.Quantize(bits=8), bucket_bytes=b, **SKIPS,
            ),
            # int8 reduce-scatter of the gradient, int8 all-gather of the parameters: each
            # half of 2 P bits / 8 (the bound's factor 2 is an all-reduce's two halves).
            {"step": 0}, bits=8,
        ),
        # Not a make_train_step optimizer: its own step on a ("node", "local") mesh, see
        # hierarchical_step (exact inside a node or slice, OneBit across, then Adam).
        Method("hierarchical", "hierarchical: exact in node, OneBit across nodes + Adam",
               lambda b, ax: optax.adam(1e-3), {"step": 0}, bits=1),
    ]  # fmt: skip
    return {m.name: m for m in ms}


def demo_bits(cfg: ModelConfig) -> float:
    """Bits per parameter of DeMo's message at its defaults (``top_k=32``, ``chunk_size=64``,
    fp32 values): the kept coefficients' offsets, packed, then their values; the message
    ``jc.demo`` all-gathers (over a tuple of axes, each device sends ``1/L`` of it across)."""
    from jaxcomm.compressors.chunks import offset_bytes
    from jaxcomm.optim.demo import demo_plan

    plans = [demo_plan(tuple(x.shape), 64, 32) for x in jax.tree.leaves(cfg.param_shapes())]
    message = offset_bytes(plans) + 4 * sum(p.kept for p in plans)
    return 8 * message / cfg.num_params()


def phases_by_count(
    method: Method, n: int, bucket_bytes: int | None, axis: AxisName = "dp", nodes: int = 1
) -> dict[int, tuple]:
    """The phase values of steps ``0..max(counts)``, from a tiny copy of the model on ``n``
    CPU devices (the schedule, not the model, decides them), over the same ``axis`` (a
    ``(nodes, n // nodes)`` mesh for ``TUPLE``)."""
    tiny = ModelConfig(layers=1, width=32, heads=2, vocab=64, seq=16, batch_per_device=2)
    cpu = jax.devices("cpu")
    if len(cpu) < n:
        raise RuntimeError(f"need {n} CPU devices for the phase probe, have {len(cpu)}")
    if axis == "dp":
        mesh = jax.sharding.Mesh(np.array(cpu[:n]), ("dp",))
    else:
        mesh = jax.sharding.Mesh(np.array(cpu[:n]).reshape(nodes, n // nodes), axis)
    tx = method.make(None if bucket_bytes is None else 1024, axis)
    step, state = jc.make_train_step(mesh, axis, make_loss(tiny), tx, tiny.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    out = {}
    for count in range(max(method.counts.values()) + 1):
        batch = rng.integers(0, tiny.vocab, (n * tiny.batch_per_device, tiny.seq + 1))
        batch = batch.astype(np.int32)
        out[count] = step.phases(state, batch)
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return out


# ---------------------------------------------------------------------------------------------
# Topologies.


H100_CONFIG = os.environ.get(
    "JAXCOMM_H100_TARGET_CONFIG",
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference",
                 "h100_target_config.txtpb"),
)  # fmt: skip


def platform_of(name: str) -> str:
    return "gpu" if name.startswith("h100") else "tpu"


def node_of(device) -> int:
    """The node a device sits in: its slice on TPU (slices talk over DCN), its host on GPU
    (hosts talk over Ethernet/InfiniBand)."""
    if getattr(device, "platform", "") == "tpu":
        return int(getattr(device, "slice_index", 0) or 0)
    return int(getattr(device, "process_index", 0) or 0)


def topology(name: str, axes: tuple[str, ...] = ("dp",)):
    """``(mesh, devices)`` for ``name``: a TPU topology string (``...x2s`` for two slices) or
    ``h100:<nodes>x1x<gpus>`` (NVIDIA H100s from the GpuTargetConfig in ``H100_CONFIG``).
    ``axes=("node", "local")`` (or ``TUPLE``) gives a 2-D mesh with one row per node (see
    :func:`node_of`), the slow axis first."""
    from jax.experimental import topologies

    if platform_of(name) == "gpu":
        with open(H100_CONFIG) as f:
            config = f.read()
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=name.split(":", 1)[1]
        )
    else:
        slices = 1
        m = re.fullmatch(r"(.+)x(\d+)s", name)
        if m:
            name, slices = m.group(1), int(m.group(2))
        kw = {"num_slices": slices} if slices > 1 else {}
        topo = topologies.get_topology_desc(name, "tpu", **kw)
    devices = sorted(topo.devices, key=lambda d: (node_of(d), d.id))
    n = len(devices)
    if axes == ("dp",):
        mesh = topologies.make_mesh(topo, (n,), axes)
    else:
        nodes = len({node_of(d) for d in devices})
        mesh = jax.sharding.Mesh(np.array(devices).reshape(nodes, n // nodes), axes)
    return mesh, list(mesh.devices.flat)


# ---------------------------------------------------------------------------------------------
# Schedule analysis of compiled HLO text.

_COMP_HEAD = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][\w\-]*)\(")
# Instructions that move no data through the compute units (bookkeeping, not overlap).
_NOT_COMPUTE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "copy-start", "copy-done", "add-dependency",
}  # fmt: skip
_COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
)  # fmt: skip


def _computations(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """computation name -> [(instruction name, opcode, line)] in schedule order."""
    comps: dict[str, list] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEAD.match(line)
            if m and not line.startswith(" ") and "=" not in line.split("(")[0]:
                current = m.group("name")
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        d = _DEF.match(line)
        if not d:
            continue
        c = _OPCODE.search(" " + d.group("rest"))
        if c:
            comps[current].append((d.group("name"), c.group("op"), line))
    return comps


def _is_async_start(op: str) -> bool:
    return op.endswith("-start") and op not in ("copy-start",)


def schedule_of_collectives(text: str) -> list[dict]:
    """Each collective of ``text`` with its async window: ``async`` (in a start/done pair),
    ``between`` (compute instructions scheduled inside the window), in program order."""
    comps = _computations(text)
    called_by: dict[str, tuple[str, str]] = {}  # computation -> (caller comp, instr name)
    for cname, instrs in comps.items():
        for name, _op, line in instrs:
            for callee in re.findall(
                r"(?:calls|to_apply|async_execution_thread=\S+ calls)=%?"
                r"([\w.\-]+)",
                line,
            ):
                called_by.setdefault(callee, (cname, name))
    out = []
    for cname, instrs in comps.items():
        for i, (name, op, line) in enumerate(instrs):
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in _COLLECTIVES:
                continue
            window_comp, start_name, start_idx = cname, name, i
            is_async = op.endswith("-start")
            if not is_async and cname in called_by:
                # A collective inside a computation run by an async-start (TPU wraps async
                # collectives so): the window is the wrapper's, in the caller.
                caller, wrapper = called_by[cname]
                idx = [n for n, _, _ in comps[caller]].index(wrapper)
                if _is_async_start(comps[caller][idx][1]):
                    window_comp, start_name, start_idx, is_async = caller, wrapper, idx, True
                elif wrapper.startswith("async-collective-start"):
                    out.append(_continuation(comps[caller], idx, name, base, cname, line))
                    continue
                elif wrapper.startswith("async-collective") or cname.startswith(
                    "async_collective_fusion"
                ):
                    continue  # a later step of a continuation fusion: counted at its start
            between = 0
            if is_async:
                seq = comps[window_comp]
                for j in range(start_idx + 1, len(seq)):
                    n2, op2, line2 = seq[j]
                    if op2.endswith("-done") and re.search(rf"%{re.escape(start_name)}\b", line2):
                        break
                    if op2 not in _NOT_COMPUTE and not op2.endswith(("-start", "-done")):
                        between += 1
            out.append(
                dict(name=name, op=base, computation=cname, window=window_comp,
                     is_async=is_async, between=between, line=line.strip())
            )  # fmt: skip
    return out


def _continuation(seq: list, start: int, name: str, op: str, comp: str, line: str) -> dict:
    """A collective of XLA:TPU's async collective fusion ("continuation fusion"): started by
    the fusion ``seq[start]`` (``async-collective-start``), advanced inside the compute fusions
    that take its state, finished by an ``async-collective-done`` fusion. Its window is from
    the start to that done; the fusions that carry its state count as compute inside it."""
    chain = {seq[start][0]}
    between = 0
    for n2, op2, line2 in seq[start + 1 :]:
        uses = any(re.search(rf"%{re.escape(c)}\b", line2.split("=", 1)[1]) for c in chain)
        if uses and n2.startswith("async-collective-done"):
            break
        if uses:
            chain.add(n2)
        if op2 not in _NOT_COMPUTE and not op2.endswith(("-start", "-done")):
            between += 1
    return dict(name=name, op=op, computation=comp, window=comp, is_async=True,
                between=between, line=line.strip())  # fmt: skip


def megascale_transfers(text: str) -> list[dict]:
    """The cross-slice (DCN) traffic of a multislice program: libtpu compiles one program per
    slice, whose HLO collectives stay inside the slice, and sends what crosses slices as host
    transfers handled by ``xla_megascale_runtime`` (``send``/``recv`` pairs). ``bytes`` is a
    transfer's payload, ``wire_bytes`` what this device sends to other slices
    (:func:`_megascale_wire`)."""
    out = []
    for instrs in _computations(text).values():
        names = [n for n, _, _ in instrs]
        for i, (name, op, line) in enumerate(instrs):
            if op not in ("send", "recv") or "xla_megascale" not in line:
                continue
            # (payload, u32[], token[]) send(...): the payload is the first array.
            shape = line.split("=", 1)[1].split(f" {op}(", 1)[0]
            arrays = re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", shape)[:1]
            nbytes = sum(
                int(np.prod([int(x) for x in dims.split(",") if x] or [1])) * DTYPE_BYTES.get(dt, 0)
                for dt, dims in arrays
            )
            between = 0
            for j in range(i + 1, len(instrs)):
                n2, op2, line2 = instrs[j]
                if op2 == f"{op}-done" and re.search(rf"%{re.escape(name)}\b", line2):
                    break
                if op2 not in _NOT_COMPUTE and op2 not in ("send", "recv", f"{op}-done"):
                    between += 1
            first = re.search(r"[a-z]+[0-9]*\[[0-9,]*\](?:\{[^}]*\})?", shape)
            tiled = tiled_bytes(first.group(0)) if first else None
            kind, group, wire = _megascale_wire(line, nbytes)
            share = 1.0 if wire is None or not nbytes else wire / nbytes
            out.append(dict(op=op, dtypes=sorted({a[0] for a in arrays}), bytes=int(nbytes),
                            tiled_bytes=int(nbytes if tiled is None else tiled),
                            kind=kind, group=group,
                            wire_bytes=float(nbytes if wire is None else wire),
                            tiled_wire_bytes=float(nbytes if tiled is None else tiled) * share,
                            modelled=wire is not None,
                            between=between, index=names.index(name)))  # fmt: skip
    return out


def _megascale_group(target: str) -> tuple[int, int] | None:
    """``(members, members in another slice)`` of one device's group in a megascale target:
    ``{{100000,200000},...}`` (explicit: slice ``id // 100000``, the groups alike) or
    ``{1,2}x{0:3}`` (slices x chips: one chip of each listed slice)."""
    explicit = re.match(r"\{\{([0-9,]+)\}", target)
    if explicit:
        ids = [int(x) for x in explicit.group(1).split(",")]
        first = ids[0] // 100000
        return len(ids), sum(1 for i in ids if i // 100000 != first)
    compact = re.match(r"\{([0-9,:]+)\}x\{", target)
    if compact:
        count = 0
        for part in compact.group(1).split(","):
            lo, _, hi = part.partition(":")
            count += int(hi) - int(lo) + 1 if hi else 1
        return count, count - 1
    return None


def _megascale_wire(line: str, payload: int) -> tuple[str, list | None, float | None]:
    """``(kind, group, bytes this device sends to other slices)`` of a megascale transfer
    whose payload (the send's first array) is ``payload`` bytes, under the ring/pairwise model
    of ``jaxcomm.inspect``: an all-to-all sends the rows of the devices in other slices, an
    all-gather its shard to each of them, an all-reduce ``2 (G - 1) / G`` of it
    (``(G, in other slices)`` the group); ``None`` for a kind or target not modelled."""
    kind = re.search(r'_xla_megascale_transfer_type="([A-Z_]+)"', line)
    target = re.search(r'_xla_megascale_target="?(\{[^"]*?\}\}?)"?,', line)
    k = kind.group(1) if kind else "?"
    group = _megascale_group(target.group(1)) if target else None
    if not group:
        return k, None, None
    size, off = group
    wire = {
        "ALL_TO_ALL": payload * off / size,
        "ALL_GATHER": payload * off,
        "ALL_REDUCE": 2 * payload * off / size,
        "REDUCE_SCATTER": payload * off / size,
    }.get(k)
    return k, list(group), wire


def _done_shapes(text: str) -> dict[str, int]:
    """start instruction name -> bytes of its ``-done``'s result."""
    out = {}
    for instrs in _computations(text).values():
        for _name, op, line in instrs:
            if not op.endswith("-done") or op in ("copy-done", "send-done", "recv-done"):
                continue
            m = re.search(rf"{re.escape(op)}\(%([\w.\-]+)", line)
            shape = line.split("=", 1)[1].split(f" {op}(", 1)[0]
            arrays = re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", shape)
            if m:
                out[m.group(1)] = sum(
                    int(np.prod([int(x) for x in d.split(",") if x] or [1])) * DTYPE_BYTES.get(t, 0)
                    for t, d in arrays
                )
    return out


_LAYOUT = re.compile(
    r"\b(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]\{(?P<order>[0-9,]*):T\((?P<tile>[0-9,]+)\)"
)


def tiled_bytes(shape_text: str) -> int | None:
    """Bytes of the arrays of an HLO shape as laid out in memory: the dims under each array's
    first tile (``T(4,128)``: the two most minor dims, in layout order) rounded up to whole
    tiles. On TPU a uint8 ``(1, R)`` row takes 4 tiles' rows (``T(4,128)``): 4x its bytes, as
    the all-gather emitter's ``shard_size`` shows. ``None`` where the shape has no tiled layout.
    """
    total = None
    for m in _LAYOUT.finditer(re.sub(r"/\*.*?\*/", "", shape_text)):
        if m.group("dtype") not in DTYPE_BYTES:
            continue
        dims = [int(d) for d in m.group("dims").split(",") if d]
        order = [int(d) for d in m.group("order").split(",") if d]  # minor to major
        tile = [int(t) for t in m.group("tile").split(",")]
        physical = [dims[i] for i in reversed(order)] if order else dims
        for j in range(1, min(len(tile), len(physical)) + 1):
            physical[-j] = -(-physical[-j] // tile[-j]) * tile[-j]
        size = int(np.prod(physical, dtype=np.int64)) * DTYPE_BYTES[m.group("dtype")]
        total = (total or 0) + size
    return total


def _result_shape(line: str, done_lines: dict[str, str], name: str | None) -> str:
    """The result shape text of a collective: its ``-done``'s for an async start."""
    text = done_lines.get(name, line) if name else line
    m = re.search(r"=\s*(?P<shape>.+?)\s+[a-z][\w\-]*\(", text)
    return m.group("shape") if m else ""


def _done_lines(text: str) -> dict[str, str]:
    """start instruction name -> line of its ``-done``."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"\s([a-z][\w\-]*-done)\(%([\w.\-]+)", line)
        if m and m.group(1) not in ("copy-done", "send-done", "recv-done"):
            out[m.group(2)] = line
    return out


def analyse(text: str, devices: list) -> dict:
    """Collectives (kind, dtype, bytes), their overlap and their slice crossings."""
    ops = collectives_in_hlo(text)
    sched = {s["line"]: s for s in schedule_of_collectives(text)}
    slices = [node_of(d) for d in devices]
    if num_devices(text) < len(devices):
        # One program per slice: replica groups index one slice's devices (ICI only).
        slices = [0] * len(devices)
    dcn = megascale_transfers(text)
    done_shape = _done_shapes(text)
    done_line = _done_lines(text)
    rows = []
    for o in ops:
        if o.line not in sched:
            continue  # a continuation fusion's later step: the same collective again
        s = sched[o.line]
        if "-start(" in o.line and o.op != "all-reduce":
            # An async start's shape is (operands, results, context scalars): TPU's carries two
            # u32 scalars, which a half-split of the tuple would count as the payload. The
            # matching done's shape is the result itself.
            result = done_shape.get(s.get("name"), 0)
            if result:
                payload = result * (o.group_size if o.op == "reduce-scatter" else 1)
                o = dataclasses.replace(o, payload_bytes=payload, wire_bytes=(
                    payload if o.op == "collective-permute"
                    else payload * (o.group_size - 1) / o.group_size))  # fmt: skip
        groups = replica_groups(o.line, len(devices))
        crosses = any(len({slices[i] for i in g if i < len(slices)}) > 1 for g in groups)
        tiled = tiled_bytes(_result_shape(o.line, done_line, s.get("name")))
        if tiled is not None and o.op == "reduce-scatter":
            tiled *= o.group_size
        tiled_wire = o.wire_bytes
        if tiled is not None and o.payload_bytes:
            tiled_wire = o.wire_bytes * tiled / o.payload_bytes
        rows.append(
            dict(op=o.op, dtypes=list(o.dtypes), payload_bytes=o.payload_bytes,
                 group_size=o.group_size, wire_bytes=o.wire_bytes, tiled_wire_bytes=tiled_wire,
                 is_async=bool(s.get("is_async")), between=int(s.get("between", 0)),
                 crosses_slices=crosses,
                 op_name=(re.search(r'op_name="([^"]*)"', o.line) or [None, ""])[1][-80:])
        )  # fmt: skip
    total = sum(r["wire_bytes"] for r in rows)
    overlapped = sum(r["wire_bytes"] for r in rows if r["is_async"] and r["between"] > 0)
    by_kind: dict[str, dict] = {}
    for r in rows:
        key = f"{r['op']}:{'/'.join(r['dtypes'])}"
        k = by_kind.setdefault(key, dict(count=0, wire_bytes=0.0, async_count=0))
        k["count"] += 1
        k["wire_bytes"] += r["wire_bytes"]
        k["async_count"] += r["is_async"]
        k["tiled_wire_bytes"] = k.get("tiled_wire_bytes", 0.0) + r["tiled_wire_bytes"]
    return dict(
        collectives=rows,
        by_kind=by_kind,
        wire_bytes=total,
        tiled_wire_bytes=sum(r["tiled_wire_bytes"] for r in rows),
        async_pairs=sum(r["is_async"] for r in rows),
        overlap_fraction=(overlapped / total) if total else None,
        # Bytes each device sends to other slices or hosts: crossing collectives, and the
        # megascale transfers under the same wire model (dcn_transfers); their payloads apart.
        cross_slice_bytes=sum(r["wire_bytes"] for r in rows if r["crosses_slices"])
        + sum(t["wire_bytes"] for t in dcn if t["op"] == "send"),
        cross_slice_tiled_bytes=sum(r["tiled_wire_bytes"] for r in rows if r["crosses_slices"])
        + sum(t["tiled_wire_bytes"] for t in dcn if t["op"] == "send"),
        dcn_send_payload_bytes=sum(t["bytes"] for t in dcn if t["op"] == "send"),
        dcn_unmodelled=sum(not t["modelled"] for t in dcn if t["op"] == "send"),
        dcn_sends=[t for t in dcn if t["op"] == "send"],
        dcn_send_dtypes=sorted({d for t in dcn if t["op"] == "send" for d in t["dtypes"]}),
        dcn_send_overlap_fraction=(
            sum(t["bytes"] for t in dcn if t["op"] == "send" and t["between"] > 0)
            / max(sum(t["bytes"] for t in dcn if t["op"] == "send"), 1)
        )
        if dcn
        else None,
    )


# ---------------------------------------------------------------------------------------------
# Two levels: what crosses the slow link (between GPU hosts, between TPU slices) per device.

# The target of the tuple axis: at most BOUND_FACTOR x (2 P bits / 8) / n_fast bytes per device
# across the slow axis, plus SCALAR_SLACK bytes of scalars (the loss, finite flags, norms).
BOUND_FACTOR = 1.3
SCALAR_SLACK = 4096


def dcn_transfers(text: str) -> list[dict]:
    """The megascale sends of a multislice TPU program (:func:`megascale_transfers`): what each
    device sends to other slices."""
    return [t for t in megascale_transfers(text) if t["op"] == "send"]


def level_bytes(
    text: str, analysis: dict, mesh, cfg: ModelConfig, method: Method, phase: str,
    two_level: bool,
) -> dict:  # fmt: skip
    """Bytes per device that cross the slow link and that stay inside a node or slice, and the
    tuple axis's target for them.

    GPU (one program over every device): a collective crosses when its groups hold devices of
    two hosts (``process_index``); its bytes count whole (a flat collective's count whole too,
    though part of it stays inside a host). For a 2-D mesh the split is checked against
    ``jc.wire_bytes_by_axes``. TPU multislice (one program per slice): the HLO's collectives
    stay inside the slice (ICI); what crosses slices is the megascale transfers
    (:func:`dcn_transfers`), counted per device with the same wire model.

    The bound: ``BOUND_FACTOR x (2 P bits / 8) / n_fast + SCALAR_SLACK`` with ``P`` the model's
    parameters, ``bits`` the method's (``Method.bits``), ``n_fast`` the devices per node; a
    ``silent`` phase (DiLoCo's inner step) is held to ``SCALAR_SLACK`` alone. ``target`` says
    whether the row is a two-level one, the rows the bound is for."""
    nodes = len({node_of(d) for d in mesh.devices.flat})
    n_fast = mesh.devices.size // nodes
    rows = analysis["collectives"]
    dcn = dcn_transfers(text)
    if dcn or num_devices(text) < mesh.devices.size:  # TPU multislice
        slow = sum(t["wire_bytes"] for t in dcn)
        fast = sum(r["wire_bytes"] for r in rows)
        by_axes = None
    else:
        slow = sum(r["wire_bytes"] for r in rows if r["crosses_slices"])
        fast = sum(r["wire_bytes"] for r in rows if not r["crosses_slices"])
        by_axes = None
        if mesh.devices.ndim == 2:  # the library's own split, by the mesh's axes
            split = jc.wire_bytes_by_axes(text, mesh)
            by_axes = {",".join(k) or "none": v for k, v in split.items()}
            across = sum(v for k, v in split.items() if mesh.axis_names[0] in k)
            if abs(across - slow) > 1e-6 * max(slow, 1):
                print(f"  note: slow-axis bytes {slow:.0f} here, {across:.0f} by "
                      f"jc.wire_bytes_by_axes", flush=True)  # fmt: skip
    bits = method.bits(cfg) if callable(method.bits) else method.bits
    params = cfg.num_params()
    silent = phase in method.silent
    if bits is None:
        bound = None
    else:
        bound = 0.0 if silent else BOUND_FACTOR * 2 * params * bits / 8 / n_fast
    return dict(
        nodes=int(nodes), n_fast=int(n_fast), parameters=params, bits=bits,
        slow_bytes=float(slow), fast_bytes=float(fast), by_axes=by_axes,
        dcn_transfers=len(dcn), dcn_unmodelled=sum(not t["modelled"] for t in dcn),
        bound_bytes=bound, slack_bytes=SCALAR_SLACK, silent=silent, target=two_level,
        passes=None if bound is None else bool(slow <= bound + SCALAR_SLACK),
        ratio_to_reference=(slow / (2 * params * bits / 8 / n_fast)) if bits else None,
    )  # fmt: skip


def peak_bytes(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    peak = getattr(m, "peak_memory_in_bytes", 0) or 0
    if peak:
        return int(peak)
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# One method on one topology.


def abstract_step(
    mesh, method: Method, cfg: ModelConfig, bucket_bytes: int | None, axis: AxisName = "dp"
):
    """``(step, state, batch)``: the user's ``jc.make_train_step`` on ``mesh`` over ``axis``
    (``"dp"`` or ``TUPLE``), its state and a batch as ``ShapeDtypeStruct``s placed on ``mesh``.
    ``make_train_step`` runs under ``jax.eval_shape``, so its initial state is traced, never
    computed (no TPU is attached)."""
    made = {}
    tx = method.make(bucket_bytes, axis)

    def build(params):
        step, state = jc.make_train_step(mesh, axis, make_loss(cfg), tx, params)
        made["step"] = step
        return state

    state = jax.eval_shape(build, cfg.param_shapes())
    specs = jc.train_state_specs(state, axis)
    state = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
        state,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    n = mesh.devices.size
    batch = jax.ShapeDtypeStruct(
        (n * cfg.batch_per_device, cfg.seq + 1), jnp.int32, sharding=NamedSharding(mesh, P(axis))
    )
    return made["step"], state, batch


def compile_one(lower: Callable, flags: dict[str, str]):
    t0 = time.perf_counter()
    lowered = lower()
    compiled = lowered.compile(compiler_options=dict(flags)) if flags else lowered.compile()
    return compiled, time.perf_counter() - t0


def cost_of(compiled) -> dict | None:
    """``flops`` and ``bytes accessed`` per device from XLA's cost analysis (None where the
    backend gives none, e.g. XLA:GPU compiled without a GPU)."""
    try:
        c = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - optional
        return None
    if isinstance(c, list | tuple):
        c = c[0] if c else None
    if not c:
        return None
    keep = ("flops", "bytes accessed", "transcendentals")
    return {k: float(v) for k, v in c.items() if k in keep}


def hierarchical_step(mesh, cfg: ModelConfig, bucket_bytes: int | None):
    """``(jitted step, abstract args)`` of a data-parallel Adam step whose gradient mean is
    ``jc.hierarchical_pmean`` on ``mesh`` ``("node", "local")``: exact reduce-scatter and
    all-gather inside a node, OneBit with error feedback across nodes."""
    comp = jc.OneBit()
    nodes, local = mesh.devices.shape
    both = ("node", "local")
    shapes = cfg.param_shapes()
    opt = optax.adam(1e-3)
    ef = jax.eval_shape(
        lambda: jc.init_hierarchical_state(
            comp, shapes, inner_size=local, outer_size=nodes, bucket_bytes=bucket_bytes
        )
    )
    loss_fn = make_loss(cfg)

    def body(params, opt_state, ef, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        mean, ef = jc.hierarchical_pmean(
            grads, ef, inner_axis="local", outer_axis="node", compressor=comp,
            bucket_bytes=bucket_bytes,
        )  # fmt: skip
        updates, opt_state = opt.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ef, jax.lax.pmean(loss, both)

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh,
            in_specs=(P(), P(), P(both), P(both)), out_specs=(P(), P(), P(both), P()),
            check_vma=False,  # replicated parameters, per-device gradients: the usual DP step
        ),
        donate_argnums=(0, 1, 2),
    )  # fmt: skip

    def placed(x, spec, lead=1):
        shape = (lead * x.shape[0], *x.shape[1:]) if x.shape else (lead,)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec))

    n = nodes * local
    args = (
        jax.tree.map(lambda x: placed(x, P()), shapes),
        jax.tree.map(lambda x: placed(x, P()) if x.shape else jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P())), jax.eval_shape(opt.init, shapes)),
        jax.tree.map(lambda x: placed(x, P(both), n), ef),
        jax.ShapeDtypeStruct((n * cfg.batch_per_device, cfg.seq + 1), jnp.int32,
                             sharding=NamedSharding(mesh, P(both))),
    )  # fmt: skip
    return fn, args


def compile_row(row: dict, lower: Callable, mesh, method: Method, cfg, out: str) -> None:
    """Compiles ``lower()`` with the row's compiler options and fills ``row`` in: compile time,
    memory, cost, the saved HLO's file, its analysis and, on several nodes, its ``levels``
    (:func:`level_bytes`); or the error."""
    axes = row["axes"]
    try:
        compiled, secs = compile_one(lower, row["compiler_options"])
        text = compiled.as_text()
        tag = ".tuple" if axes == list(TUPLE) else ""
        fname = (f"{row['method']}{tag}.{row['phase']}.{row['topology'].replace(':', '_')}."
                 f"{row['flags']}.hlo.txt")  # fmt: skip
        with open(os.path.join(out, fname), "w") as f:
            f.write(text)
        analysis = analyse(text, list(mesh.devices.flat))
        row.update(
            compiles=True, compile_s=secs, peak_bytes=peak_bytes(compiled),
            cost=cost_of(compiled), hlo_bytes=hlo_bytes_accessed(text), hlo_file=fname,
            analysis=analysis,
        )  # fmt: skip
        if row["slices"] > 1:
            row["levels"] = level_bytes(
                text, analysis, mesh, cfg, method, row["phase"], two_level=axes != ["dp"]
            )
    except Exception as e:  # noqa: BLE001 - the report records any failure
        row.update(compiles=False, error=f"{type(e).__name__}: {e}"[:2000])
    a = row.get("analysis") or {}
    lv = row.get("levels") or {}
    across = ""
    if lv:
        bound = "-" if lv["bound_bytes"] is None else _fmt_bytes(lv["bound_bytes"])
        across = f" across {_fmt_bytes(lv['slow_bytes'])} (bound {bound}) inside " + _fmt_bytes(
            lv["fast_bytes"]
        )
    print(
        f"[{row['topology']} {'/'.join(axes)} {row['method']}/{row['phase']} {row['flags']}] "
        f"{'ok' if row['compiles'] else 'FAILED ' + row['error'][:300]} "
        f"{row.get('compile_s', 0):.0f}s peak {_fmt_bytes(row.get('peak_bytes'))}"
        f" accessed {_fmt_bytes(accessed_of(row))} wire {_fmt_bytes(a.get('wire_bytes'))}"
        f" overlap {a.get('overlap_fraction')}{across}",
        flush=True,
    )


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "libtpu", "optax", "jaxcomm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def accessed_of(row: dict) -> float | None:
    """Bytes accessed per device of the row's program: XLA's cost analysis, or where the
    compiled program exposes none (XLA:GPU compiled without a GPU) the HLO count of
    ``benchmarks/hlo_bytes.py`` (``None`` in rows recorded before it)."""
    measured = (row.get("cost") or {}).get("bytes accessed")
    return row.get("hlo_bytes") if measured is None else measured


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'method':<14}{'phase':<11}{'topology':<12}{'flags':<8}{'ok':<4}{'compile s':>10}"
        f"{'peak/dev':>11}{'accessed':>11}{'wire/dev':>11}{'async':>7}{'overlap':>9}"
        f"{'DCN/dev':>11}{'DCN ovl':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        a = r.get("analysis") or {}
        ov = a.get("overlap_fraction")
        n_coll = len(a.get("collectives", []))
        print(
            f"{r['method']:<14}{r['phase']:<11}{r['topology']:<12}{r['flags']:<8}"
            f"{'yes' if r['compiles'] else 'NO':<4}{r.get('compile_s', 0):>10.1f}"
            f"{_fmt_bytes(r.get('peak_bytes')):>11}{_fmt_bytes(accessed_of(r)):>11}"
            f"{_fmt_bytes(a.get('wire_bytes')):>11}"
            f"{(str(a.get('async_pairs', 0)) + '/' + str(n_coll)) if a else '-':>7}"
            f"{('-' if ov is None else f'{ov:.0%}'):>9}"
            f"{_fmt_bytes(a.get('cross_slice_bytes')) if r['slices'] > 1 else '-':>11}"
            f"{_pct(a.get('dcn_send_overlap_fraction')) if r['slices'] > 1 else '-':>9}"
        )
    levels = [r for r in rows if r.get("levels")]
    if levels:
        print()
        print(
            "across the slow link (hosts or slices) and inside a node, bytes per device; bound: "
            f"{BOUND_FACTOR} x (2 P bits / 8) / n_fast + {SCALAR_SLACK} B of scalars "
            "(two-level rows)"
        )
        head = (
            f"{'method':<14}{'phase':<11}{'axes':<12}{'topology':<12}{'flags':<8}{'bits':>6}"
            f"{'across':>12}{'inside':>12}{'bound':>12}{'x ref':>7}{'target':>8}"
        )
        print(head)
        print("-" * len(head))
        for r in levels:
            lv = r["levels"]
            bits = lv["bits"]
            verdict = "-" if not lv["target"] or lv["passes"] is None else (
                "pass" if lv["passes"] else "FAIL")  # fmt: skip
            ref = lv["ratio_to_reference"]
            print(
                f"{r['method']:<14}{r['phase']:<11}{'/'.join(r['axes']):<12}{r['topology']:<12}"
                f"{r['flags']:<8}{'-' if bits is None else f'{bits:.3g}':>6}"
                f"{_fmt_bytes(lv['slow_bytes']):>12}{_fmt_bytes(lv['fast_bytes']):>12}"
                f"{_fmt_bytes(lv['bound_bytes']):>12}{'-' if ref is None else f'{ref:.2f}':>7}"
                f"{verdict:>8}"
            )
    print()
    print("collectives by kind (count, async count, bytes per device):")
    for r in rows:
        a = r.get("analysis")
        if not a:
            print(f"  {r['method']}/{r['phase']} {r['topology']} {r['flags']}: {r.get('error')}")
            continue
        kinds = ", ".join(
            f"{k} x{v['count']} ({v['async_count']} async) {_fmt_bytes(v['wire_bytes'])}"
            f" (tiled {_fmt_bytes(v.get('tiled_wire_bytes'))})"
            for k, v in sorted(a["by_kind"].items())
        )
        print(f"  {r['method']}/{r['phase']} {r['topology']} {r['flags']}: {kinds}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="v5e:2x2,v5p:2x2x1,v5e:2x2x2s")
    p.add_argument("--methods", default=",".join(methods()))
    p.add_argument("--flags", default="default,async", help="flag sets: default, async")
    p.add_argument(
        "--axes", default="flat",
        help="flat (one axis 'dp' over every device), tuple (('host', 'local'): exact inside a "
        "node or slice, compressed across; topologies of several nodes only) or flat,tuple",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch-per-device", type=int, default=4)
    p.add_argument("--bucket-bytes", type=int, default=25 << 20, help="0: one bucket per dtype")
    p.add_argument("--out", default="/tmp/jaxcomm-aot", help="folder for the JSON and the HLO")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--reanalyse", action="store_true", help="re-read the HLO files in --out")
    args = p.parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.out)

    cfg = ModelConfig(
        layers=args.layers, width=args.width, heads=max(args.width // 64, 1), seq=args.seq,
        vocab=args.vocab,
        batch_per_device=args.batch_per_device,
    )  # fmt: skip
    bucket = args.bucket_bytes or None
    table = methods()
    unknown = [m for m in args.methods.split(",") if m not in table]
    if unknown:
        p.error(f"unknown methods {unknown}; known: {sorted(table)}")
    os.makedirs(args.out, exist_ok=True)
    print(f"model: {cfg.num_params() / 1e6:.1f}M parameters, {cfg}, bucket_bytes={bucket}")

    rows: list[dict] = []
    phase_cache: dict[tuple, dict[int, tuple]] = {}
    kinds = args.axes.split(",")
    for topo_name in args.topologies.split(","):
        flat_mesh, flat_devices = topology(topo_name)
        n = len(flat_devices)
        n_slices = len({node_of(d) for d in flat_devices})
        plat = platform_of(topo_name)
        SKIPS.clear()
        for kind in kinds:
            if kind == "tuple" and n_slices < 2:
                print(f"[{topo_name}] one node: no tuple-axis rows", flush=True)
                continue
            axis = TUPLE if kind == "tuple" else "dp"
            mesh, devices = topology(topo_name, TUPLE) if kind == "tuple" else (
                flat_mesh, flat_devices)  # fmt: skip
            for mname in args.methods.split(","):
                method = table[mname]
                if mname == "hierarchical":
                    if n_slices < 2 or kind != kinds[0]:
                        continue  # needs a slow axis; its own two-level step, compiled once
                    mesh2, devs = topology(topo_name, ("node", "local"))
                    fn, fargs = hierarchical_step(mesh2, cfg, bucket)
                    programs = [("step", (), lambda fn=fn, fargs=fargs: fn.lower(*fargs))]
                    row_axes, row_mesh = ["node", "local"], mesh2
                else:
                    key = (mname, n, kind)
                    if key not in phase_cache:
                        phase_cache[key] = phases_by_count(method, n, bucket, axis, n_slices)
                    step, state, batch = abstract_step(mesh, method, cfg, bucket, axis)
                    ph_of = phase_cache[key]
                    programs = [
                        (label, ph_of[c],
                         lambda ph=ph_of[c], st=step, a=(state, batch): st.program(ph).lower(*a))
                        for label, c in method.counts.items()
                    ]  # fmt: skip
                    row_axes, row_mesh = list(axis) if kind == "tuple" else ["dp"], mesh
                what = method.what + (", tuple axis (host, local)" if kind == "tuple" else "")
                for label, phases, lower in programs:
                    for flag_name in args.flags.split(","):
                        row = dict(
                            method=mname, what=what, phase=label, phase_values=list(phases),
                            axes=row_axes, topology=topo_name, platform=plat, devices=n,
                            slices=n_slices, flags=flag_name,
                            compiler_options=flag_set(plat, flag_name, bucket),
                            device_kind=devices[0].device_kind, optimizer_extra=dict(SKIPS),
                        )  # fmt: skip
                        compile_row(row, lower, row_mesh, method, cfg, args.out)
                        rows.append(row)
                        _write(args, cfg, bucket, rows)

    print()
    print_table(rows)
    _write(args, cfg, bucket, rows)
    print(f"\nJSON and HLO in {args.out}")
    return 0


def reanalyse(out: str) -> int:
    """Recomputes every row's analysis (and, on several nodes, its levels) from the HLO files
    saved in ``out``."""
    path = os.path.join(out, "aot_report.json")
    with open(path) as f:
        report = json.load(f)
    cfg = ModelConfig(**{k: v for k, v in report["model"].items() if k != "parameters"})
    table = methods()
    for row in report["rows"]:
        if row.get("hlo_file"):
            axes = tuple(row.get("axes", ["dp"]))
            mesh, devices = topology(row["topology"], axes)
            with open(os.path.join(out, row["hlo_file"])) as f:
                text = f.read()
            row["analysis"] = analyse(text, devices)
            if row["slices"] > 1:
                row["levels"] = level_bytes(
                    text, row["analysis"], mesh, cfg, table[row["method"]], row["phase"],
                    two_level=axes != ("dp",),
                )  # fmt: skip
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print_table(report["rows"])
    return 0


def _source() -> dict:
    """The commit of the jaxcomm measured and whether its ``jaxcomm/`` differed from it."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(jc.__file__)))

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", "-C", root, *argv], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", "jaxcomm")
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "jaxcomm_modified": bool(dirty)}


def _write(args, cfg: ModelConfig, bucket: int | None, rows: list[dict]) -> None:
    report = dict(
        command=" ".join([sys.executable, *sys.argv]),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.machine(),
                     cpus=os.cpu_count(), cpu=cpu_model()),
        versions=_versions(),
        model=dict(cfg.__dict__, parameters=cfg.num_params()),
        bucket_bytes=bucket,
        flag_sets=FLAG_SETS,
        overlap_definition=(
            "share of the collectives' bytes per device whose collective is asynchronous and "
            "has at least one compute instruction scheduled between its start and its done"
        ),
        levels_definition=(
            "levels (topologies of several hosts or slices): slow_bytes, what each device sends "
            "across hosts (GPU: collectives whose groups span two process_index values, counted "
            "whole) or slices (TPU: the megascale transfers, the rows or shards bound for other "
            "slices); fast_bytes, the other collectives' bytes. bound_bytes = "
            f"{BOUND_FACTOR} x (2 P bits / 8) / n_fast, P the parameters, bits the method's "
            "compressor's bits per parameter (DeMo: its message's), n_fast the devices per "
            f"node; passes: slow_bytes <= bound_bytes + {SCALAR_SLACK} (scalars); a silent phase "
            "(DiLoCo's inner step) has bound 0. The target is for the two-level rows (axes "
            "host/local or node/local); flat rows are there to compare"
        ),
        rows=rows,
    )  # fmt: skip
    report.update(_source())
    for path in filter(None, (os.path.join(args.out, "aot_report.json"), args.json)):
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
