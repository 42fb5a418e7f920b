"""Collectives and bytes on the wire, read from compiled HLO text.

Timing a collective tells you little about *what* crossed the wire; XLA may have moved a convert
across a collective and silently widened a compressed payload. The compiled program says exactly
which collectives run, on what dtype and shape, over which device groups. From that, bytes per
device follow the standard ring/pairwise cost model (the factors nccl-tests and DeepSpeed's
``ds_bench`` use for bus bandwidth), with ``g`` the replica-group size:

=================  ======================================
all-reduce         ``2 (g-1)/g * S``   (S = operand bytes)
all-gather         ``(g-1)/g * S``     (S = gathered result bytes)
reduce-scatter     ``(g-1)/g * S``     (S = operand bytes = g * result)
all-to-all         ``(g-1)/g * S``     (S = operand bytes)
collective-permute ``S``
=================  ======================================

Usage::

    text = jax.jit(f).lower(*args).compile().as_text()
    ops = collectives_in_hlo(text)
    total = wire_bytes(text)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# fmt: off
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1,
}

#: HLO opcodes counted as collectives (async ``-start`` forms are mapped to their base op;
#: the matching ``-done`` carries no new payload and is skipped).
COLLECTIVE_OPS = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
)
# fmt: on

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(re.escape(o) for o in COLLECTIVE_OPS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+[0-9]*[a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<body>\{[0-9,{} ]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<dims>[0-9,]+)\]<=")
_EMPTY_GROUPS = re.compile(r"replica_groups=\{\}")


@dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled program.

    Attributes:
      op: base HLO opcode (``all-reduce``, ``all-gather``, ...).
      dtypes: element types of its payload arrays.
      payload_bytes: bytes of the arrays the cost model is stated in (see module docstring).
      group_size: devices per replica group.
      wire_bytes: bytes each device sends under the ring/pairwise model.
      line: the HLO instruction, for reports.
    """

    op: str
    dtypes: tuple[str, ...]
    payload_bytes: int
    group_size: int
    wire_bytes: float
    line: str


def _arrays(shape_text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of each array in an HLO shape (a tuple shape lists several)."""
    shape_text = re.sub(r"/\*.*?\*/", "", shape_text)
    out = []
    for m in _ARRAY.finditer(shape_text):
        dtype = m.group("dtype")
        if dtype not in _DTYPE_BYTES:
            continue
        dims = [int(d) for d in m.group("dims").split(",") if d]
        out.append((dtype, int(np.prod(dims, dtype=np.int64) * _DTYPE_BYTES[dtype])))
    return out


def _group_size(line: str, default: int) -> int:
    m = _GROUPS_LIST.search(line)
    if m:
        first = re.search(r"\{([0-9, ]*)\}", m.group("body"))
        members = [t for t in first.group(1).split(",") if t.strip()] if first else []
        return max(len(members), 1)
    m = _GROUPS_IOTA.search(line)
    if m:
        dims = [int(d) for d in m.group("dims").split(",")]
        return dims[-1] if len(dims) > 1 else dims[0]
    return default


def _num_devices(text: str) -> int:
    m = re.search(r"num_partitions=(\d+)", text)
    parts = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", text)
    replicas = int(m.group(1)) if m else 1
    return max(parts * replicas, 1)


def collectives_in_hlo(text: str) -> list[CollectiveOp]:
    """Every collective instruction of an HLO module's text, in program order."""
    default_group = _num_devices(text)
    ops = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op = m.group("op")
        arrays = _arrays(m.group("shape"))
        if m.group("start"):
            # Async start ops return (operands..., results..., [context]); count the result half.
            arrays = arrays[len(arrays) // 2 :] if op != "all-reduce" else arrays
        group = _group_size(line, default_group)
        payload = sum(b for _, b in arrays)
        if op == "reduce-scatter":
            payload *= group  # result is one shard; the cost model is stated in operand bytes
        ops.append(
            CollectiveOp(
                op=op,
                dtypes=tuple(sorted({d for d, _ in arrays})),
                payload_bytes=payload,
                group_size=group,
                wire_bytes=_wire_factor(op, group) * payload,
                line=line.strip(),
            )
        )
    return ops


def _wire_factor(op: str, group: int) -> float:
    if group <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (group - 1) / group
    if op in ("collective-permute", "collective-broadcast"):
        return 1.0
    return (group - 1) / group


def wire_bytes(text: str) -> float:
    """Total bytes each device sends for one run of the compiled program (ring/pairwise model)."""
    return sum(op.wire_bytes for op in collectives_in_hlo(text))


def compiled_text(fn, *args, **kwargs) -> str:
    """Compiled HLO text of ``jax.jit(fn)`` (or an already jitted ``fn``) for these arguments."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()
