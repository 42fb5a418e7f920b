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
DTYPE_BYTES = {
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
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<body>(?:\{[0-9, ]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?"
)


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
        if dtype not in DTYPE_BYTES:
            continue
        dims = [int(d) for d in m.group("dims").split(",") if d]
        out.append((dtype, int(np.prod(dims, dtype=np.int64) * DTYPE_BYTES[dtype])))
    return out


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """Device groups of one collective instruction (explicit or iota form; all devices if none)."""
    m = _GROUPS_IOTA.search(line)
    if m:
        shape = [int(d) for d in m.group("shape").split(",")]
        dims = [int(d) for d in m.group("dims").split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group("perm"):
            ids = ids.transpose([int(p) for p in m.group("perm").split(",")])
        return ids.reshape(shape[0], -1).tolist() if len(shape) > 1 else [ids.reshape(-1).tolist()]
    m = _GROUPS_LIST.search(line)
    if m and m.group("body").strip():
        return [
            [int(t) for t in g.split(",") if t.strip()]
            for g in re.findall(r"\{([0-9, ]*)\}", m.group("body"))
        ]
    return [list(range(num_devices))]


def _group_size(line: str, default: int) -> int:
    return max(len(replica_groups(line, default)[0]), 1)


def num_devices(text: str) -> int:
    m = re.search(r"num_partitions=(\d+)", text)
    parts = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", text)
    replicas = int(m.group(1)) if m else 1
    return max(parts * replicas, 1)


def _parse_collective(line: str, default_group: int) -> CollectiveOp | None:
    m = _INSTR.match(line)
    if not m:
        return None
    op = m.group("op")
    arrays = _arrays(m.group("shape"))
    if m.group("start") and op != "all-reduce":
        # Async start ops return (operands..., results..., [context]); count the result half.
        # TPU appends u32[] context scalars (e.g. its all-to-all-start): not payload.
        end = len(arrays)
        while end > 2 and arrays[end - 1] in (("u32", 4), ("s32", 4)):
            end -= 1
        if end % 2 == 0:
            arrays = arrays[:end]
        arrays = arrays[len(arrays) // 2 :]
    group = _group_size(line, default_group)
    payload = sum(b for _, b in arrays)
    if op == "reduce-scatter":
        payload *= group  # result is one shard; the cost model is stated in operand bytes
    return CollectiveOp(
        op=op,
        dtypes=tuple(sorted({d for d, _ in arrays})),
        payload_bytes=payload,
        group_size=group,
        wire_bytes=_wire_factor(op, group) * payload,
        line=line.strip(),
    )


def collectives_in_hlo(text: str) -> list[CollectiveOp]:
    """Every collective instruction of an HLO module's text, in program order."""
    default_group = num_devices(text)
    ops = (_parse_collective(line, default_group) for line in text.splitlines())
    return [o for o in ops if o is not None]


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")
_CALL = re.compile(r"\s(?P<op>[a-z][\w\-]*)\(")


def _entry_instructions(text: str) -> dict[str, tuple[str, list[str], str]]:
    """name -> (opcode, operand names, line) for the ENTRY computation of an HLO module."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("jaxcomm.inspect: no ENTRY computation in this HLO text")
    out: dict[str, tuple[str, list[str], str]] = {}
    for line in lines[start + 1 :]:
        if line.strip() == "}":
            break
        d = _DEF.match(line)
        if not d:
            continue
        rest = line[d.end() :]
        # The opcode is the first `name(` after the shape (tuple shapes hold no `word(`).
        c = _CALL.search(" " + rest)
        if not c:
            continue
        i, depth = c.end() - 1, 1
        j = i
        while j < len(rest) and depth:
            depth += (rest[j] == "(") - (rest[j] == ")")
            j += 1
        args = rest[i : j - 1]
        operands = re.findall(r"%([\w.\-]+)", args)
        if c.group("op") == "parameter":
            operands = [args.strip()]
        out[d.group("name")] = (c.group("op"), operands, line)
    return out


def collective_dependencies(text: str) -> list[tuple[CollectiveOp, frozenset[int]]]:
    """Each collective of the ENTRY computation with the entry parameters it depends on.

    Parameter numbers follow the flattened arguments of the jitted function. Two collectives
    whose parameter sets are disjoint share no data: a scheduler may run them concurrently, or
    overlap one's communication with the other's computation.
    """
    instrs = _entry_instructions(text)
    default_group = num_devices(text)
    memo: dict[str, frozenset[int]] = {}

    def deps(name: str) -> frozenset[int]:
        stack = [name]
        while stack:  # iterative post-order: HLO graphs can be deeper than Python's recursion
            cur = stack[-1]
            if cur in memo or cur not in instrs:
                memo.setdefault(cur, frozenset())
                stack.pop()
                continue
            op, operands, _ = instrs[cur]
            if op == "parameter":
                memo[cur] = frozenset({int(operands[0])})
                stack.pop()
                continue
            todo = [o for o in operands if o not in memo]
            if todo:
                stack.extend(todo)
                continue
            memo[cur] = frozenset().union(*(memo[o] for o in operands))
            stack.pop()
        return memo[name]

    out = []
    for name, (_, _, line) in instrs.items():
        coll = _parse_collective(line, default_group)
        if coll is not None:
            out.append((coll, deps(name)))
    return out


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
    text = jitted.lower(*args, **kwargs).compile().as_text()
    if text is None:
        raise ValueError("this backend gives no text for the compiled program; inspect needs it")
    return text
