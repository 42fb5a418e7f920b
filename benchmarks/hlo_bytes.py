"""Bytes through memory of a compiled XLA program, counted from its HLO text.

XLA:GPU gives no cost analysis when it compiles without a GPU (``compiled.cost_analysis()``
is ``None``), so this module recounts what XLA's ``HloCostAnalysis`` charges as "bytes
accessed" from ``compiled.as_text()``, for any backend. Two modes:

``hlo_bytes_accessed(text)`` (the measure): for every instruction executed, the bytes of its
operands plus the bytes of its output, where the size of a tuple is the sum of its arrays
(``ShapeUtil::ByteSizeOf`` of each leaf: elements x element width, or packed bits when the
layout says ``E(bits)``), and

- free (0): ``parameter``, ``constant``, ``get-tuple-element``, ``tuple``, ``bitcast``,
  ``after-all``, ``add-dependency``, ``domain``, ``opt-barrier`` (no memory moves);
- a ``fusion`` is counted at its boundary, as ``HloCostAnalysis::HandleFusion`` does: each
  output array written once, except one whose fused root is a ``dynamic-update-slice``
  (in place: the update's bytes); each fused parameter read once, except that a ``slice``
  or ``dynamic-slice`` of it reads only the slice, an in-place ``dynamic-update-slice``
  does not read its buffer, and each ``broadcast``/``reshape`` user reads it again; fused
  constants of more than one element are read; nothing inside the fusion is counted;
- ``slice``/``dynamic-slice``/``gather``: output read and written (+ the indices);
  ``dynamic-update-slice``: the update read and written (+ indices; the buffer is aliased);
  ``scatter``: 3 x the updates + the indices;
- ``while``: the condition and body computations, times the trip count XLA recorded
  (``backend_config`` ``known_trip_count``; 1 where none is known, as HloCostAnalysis);
  ``conditional``: the largest branch (the one branch that runs is not known statically);
  ``call`` and ``async-start``: the called computation (the wrapper itself free);
- collectives: operands + outputs; an async pair (``all-reduce-start``/``-done``,
  ``all-gather-*``, ``all-to-all-*``, ``collective-permute-*``, ``copy-*``, ``async-done``)
  is counted once, its operands at the start and its outputs at the done;
- ``custom-call`` (on GPU: cuBLAS/cuDNN): operands + outputs, without the ``s8`` scratch
  workspace that XLA:GPU appends to a gemm's output tuple;
- every other instruction: operands + output.

``hlo_bytes_accessed(text, mirror=True)``: exactly what ``compiled.cost_analysis()["bytes
accessed"]`` reports in XLA 0.10 (checked against XLA:CPU's, equal to 1e-6, XLA summing in
float32): the same rules, but a ``tuple`` and a tuple-shaped operand cost their pointer table
(8 bytes an element, ``ByteSizeOf(shape, 8)``), a ``while`` body counts once, a
``custom-call`` counts -1 ("unknown"), and an async ``-done`` counts its operand and output
again. On CPU the measure then differs from the cost analysis by those pointer tables and by
loops' further trips.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

#: Bytes per element (``ByteSizeOfPrimitiveType``: sub-byte types take a byte unless packed).
_WIDTH = {"pred": 1, "s1": 1, "u1": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
          "f4e2m1fn": 1, "f8e3m4": 1, "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1,
          "f8e4m3fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip
POINTER = 8  # ByteSizeOf(tuple, pointer_size): the tuple's index table

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "add-dependency", "domain", "opt-barrier"}  # fmt: skip
_STARTS = {"all-reduce-start", "all-gather-start", "all-to-all-start", "collective-permute-start",
           "copy-start", "send", "recv"}  # fmt: skip
_DONES = {"all-reduce-done", "all-gather-done", "all-to-all-done", "collective-permute-done",
          "copy-done", "async-update", "async-done", "send-done", "recv-done"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Shapes.


@dataclass(frozen=True)
class Shape:
    """An array (``dtype``, ``dims``, ``bits``: packed element bits or 0), a tuple
    (``elements``) or a token/opaque value."""

    dtype: str = ""
    dims: tuple[int, ...] = ()
    bits: int = 0
    elements: tuple[Shape, ...] | None = None

    @property
    def is_tuple(self) -> bool:
        return self.elements is not None

    @property
    def count(self) -> int:
        return math.prod(self.dims)

    def array_bytes(self) -> float:
        if self.dtype not in _WIDTH:
            return 0.0  # token[], opaque: no memory
        if self.bits:
            return float(math.ceil(self.count * self.bits / 8))
        return float(self.count * _WIDTH[self.dtype])

    def xla_size(self) -> float:
        """``ShapeUtil::ByteSizeOf(shape, 8)``: a tuple is its pointer table."""
        return POINTER * len(self.elements) if self.is_tuple else self.array_bytes()

    def leaves(self) -> list[Shape]:
        if not self.is_tuple:
            return [self]
        return [leaf for e in self.elements for leaf in e.leaves()]

    def leaf_bytes(self) -> float:
        return sum(s.array_bytes() for s in self.leaves())

    def subshapes(self, index: tuple[int, ...] = ()):
        """``(index, array)`` for every array in the shape (``ShapeUtil::ForEachSubshape``)."""
        if not self.is_tuple:
            yield index, self
            return
        for i, e in enumerate(self.elements):
            yield from e.subshapes((*index, i))


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})?")


def parse_shape(text: str) -> tuple[Shape, int]:
    """``(shape, characters consumed)`` of the shape at the start of ``text``."""
    text_len = len(text)
    i = 0
    while i < text_len and text[i] == " ":
        i += 1
    if text.startswith("(", i):
        i += 1
        elements = []
        while True:
            while i < text_len and text[i] in " ,":
                i += 1
            if text.startswith("/*", i):
                i = text.index("*/", i) + 2
                continue
            if text.startswith(")", i):
                return Shape(elements=tuple(elements)), i + 1
            sub, used = parse_shape(text[i:])
            elements.append(sub)
            i += used
    m = _ARRAY.match(text, i)
    if not m:
        raise ValueError(f"no shape at {text[i : i + 60]!r}")
    dtype, dims, layout = m.groups()
    sizes = tuple(int(d) for d in re.findall(r"\d+", dims))  # "<=" bounds: the bound
    packed = re.search(r":.*?E\((\d+)\)", layout or "")
    return Shape(dtype, sizes, int(packed.group(1)) if packed else 0), m.end()


# ---------------------------------------------------------------------------------------------
# HLO text.


@dataclass
class Instr:
    name: str
    shape: Shape
    op: str
    operands: list[str]
    attrs: str
    line: str
    root: bool = False

    def called(self, key: str) -> list[str]:
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
        return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    by_name: dict[str, Instr] = field(default_factory=dict)
    users: dict[str, list[Instr]] = field(default_factory=dict)

    @property
    def root(self) -> Instr:
        return next((i for i in self.instrs if i.root), self.instrs[-1])

    def params(self) -> dict[int, Instr]:
        out = {}
        for ins in self.instrs:
            if ins.op == "parameter":
                out[int(re.match(r"\s*(\d+)", ins.operands[0] if ins.operands else "0")[1])] = ins
        return out


_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_DEF = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP = re.compile(r"\s*([a-z][\w\-]*)\(")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    quoted = False
    for j in range(start, len(text)):
        c = text[j]
        if c == '"' and text[j - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur:
        parts.append("".join(cur))
    return parts


def parse_instruction(line: str) -> Instr | None:
    m = _DEF.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    try:
        shape, used = parse_shape(rest)
    except ValueError:
        return None
    o = _OP.match(rest, used)
    if not o:
        return None
    end = _balanced(rest, o.end() - 1)
    args = rest[o.end() : end - 1]
    operands = []
    for part in _split_top(re.sub(r"/\*.*?\*/", "", args)):
        ref = re.search(r"%([\w.\-]+)\s*$", part.strip())
        operands.append(ref.group(1) if ref else part.strip())
    op = o.group(1)
    return Instr(m.group(2), shape, op, operands, rest[end:], line, root=bool(m.group(1)))


@dataclass
class Module:
    computations: dict[str, Computation]
    entry: str

    @classmethod
    def parse(cls, text: str) -> Module:
        comps: dict[str, Computation] = {}
        entry = None
        current = None
        for line in text.splitlines():
            if current is None:
                m = _HEAD.match(line)
                if m and not line.startswith(" "):
                    current = Computation(m.group(2))
                    comps[current.name] = current
                    if m.group(1):
                        entry = current.name
                continue
            if line.startswith("}"):
                current = None
                continue
            ins = parse_instruction(line)
            if ins is None:
                continue
            current.instrs.append(ins)
            current.by_name[ins.name] = ins
        for comp in comps.values():
            for ins in comp.instrs:
                for o in dict.fromkeys(ins.operands):  # a user once, however often it reads
                    if o in comp.by_name:
                        comp.users.setdefault(o, []).append(ins)
        if entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        return cls(comps, entry)


# ---------------------------------------------------------------------------------------------
# The count.


class Counter:
    """``HloCostAnalysis``'s bytes accessed over a parsed module (see the module docstring)."""

    def __init__(self, module: Module, mirror: bool = False):
        self.m = module
        self.mirror = mirror
        self._memo: dict[str, float] = {}
        self.notes: set[str] = set()

    # sizes: XLA's (a tuple is its pointer table) or the arrays'
    def size(self, shape: Shape) -> float:
        return shape.xla_size() if self.mirror else shape.leaf_bytes()

    def operand_shape(self, comp: Computation, name: str) -> Shape | None:
        ins = comp.by_name.get(name)
        return None if ins is None else ins.shape

    def operands_bytes(self, comp: Computation, ins: Instr) -> float:
        total = 0.0
        for o in ins.operands:
            s = self.operand_shape(comp, o)
            if s is not None:
                total += self.size(s)
        return total

    def computation(self, name: str) -> float:
        if name not in self._memo:
            comp = self.m.computations[name]
            self._memo[name] = sum(self.instruction(comp, ins) for ins in comp.instrs)
        return self._memo[name]

    def instruction(self, comp: Computation, ins: Instr) -> float:
        op = ins.op
        shape_of = lambda i: self.operand_shape(comp, ins.operands[i])  # noqa: E731
        if op in FREE:
            return ins.shape.xla_size() if (op == "tuple" and self.mirror) else 0.0
        if op == "fusion":
            return self.fusion(comp, ins)
        if op == "while":
            trips = 1
            known = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
            if self.mirror:
                pass
            elif known:
                trips = int(known.group(1))
            else:
                self.notes.add(f"while {ins.name}: trip count unknown, body counted once")
            body = sum(self.computation(c) for c in ins.called("body"))
            cond = sum(self.computation(c) for c in ins.called("condition"))
            return trips * body + (cond if self.mirror else (trips + 1 if known else 1) * cond)
        if op == "conditional":
            branches = ins.called("branch_computations") or (
                ins.called("true_computation") + ins.called("false_computation"))  # fmt: skip
            if len(branches) > 1:
                self.notes.add("conditional: the largest branch counted")
            return max((self.computation(c) for c in branches), default=0.0)
        if op == "call":
            return sum(self.computation(c) for c in ins.called("to_apply"))
        if op == "async-start":
            return sum(self.computation(c) for c in ins.called("calls"))
        if op == "custom-call":
            if self.mirror:
                return -1.0
            out = ins.shape.leaves()
            target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
            if (ins.shape.is_tuple and out and out[-1].dtype in ("s8", "u8") and target
                    and re.search(r"cublas|gemm|matmul|cudnn", target.group(1))):  # fmt: skip
                out = out[:-1]  # the gemm's scratch workspace
            return sum(s.array_bytes() for s in out) + self.operands_bytes(comp, ins)
        if op == "slice":
            return 2 * self.size(ins.shape)
        if op == "dynamic-slice":
            return 2 * self.size(ins.shape) + self.size(shape_of(1))
        if op == "dynamic-update-slice":
            return 2 * self.size(shape_of(1)) + self.size(shape_of(2))
        if op == "gather":
            return 2 * self.size(ins.shape) + self.size(shape_of(1))
        if op == "scatter":
            n = (len(ins.operands) - 1) // 2
            updates = sum(self.size(shape_of(n + 1 + i)) for i in range(n))
            return 3 * updates + self.size(shape_of(n))
        if not self.mirror:
            if op in _STARTS:
                return self.operands_bytes(comp, ins)
            if op in _DONES:
                return 0.0 if op in ("async-update", "async-done") else self.size(ins.shape)
        # The default (also an async -done in mirror mode: its operand and output again):
        # every array of the output (XLA charges a tuple output's arrays, as checked against
        # cost_analysis() for sort and all-to-all) and the operands.
        return ins.shape.leaf_bytes() + self.operands_bytes(comp, ins)

    # HloCostAnalysis::HandleFusion
    def fusion(self, comp: Computation, ins: Instr) -> float:
        fused = self.m.computations[ins.called("calls")[0]]
        if re.search(r"kind=kCustom", ins.attrs):
            for inner in fused.instrs:
                if inner.op in ("gather", "scatter"):
                    return self.instruction(fused, inner)
        root = fused.root
        total = 0.0
        for index, sub in ins.shape.subshapes():
            r = root
            if len(index) == 1 and root.op == "tuple":
                r = fused.by_name.get(root.operands[index[0]], root)
            if r.op == "dynamic-update-slice":
                total += self.operand_shape(fused, r.operands[1]).xla_size()
            else:
                total += sub.array_bytes()
        for inner in fused.instrs:
            if inner.op == "constant" and not inner.shape.is_tuple and inner.shape.count > 1:
                total += inner.shape.array_bytes()
        for _, param in sorted(fused.params().items()):
            if not param.shape.is_tuple:
                total += self.parameter_read(fused, param)
                continue
            for index, _leaf in param.shape.subshapes():
                gte = param
                for k in index:
                    gte = next((u for u in fused.users.get(gte.name, [])
                                if u.op == "get-tuple-element"
                                and re.search(rf"\bindex={k}\b", u.attrs)), gte)  # fmt: skip
                total += self.parameter_read(fused, gte)
        return total

    # HloCostAnalysis::FusionParameterReadBytes
    def parameter_read(self, comp: Computation, hlo: Instr) -> float:
        size = 0.0
        seen = False
        for user in comp.users.get(hlo.name, []):
            op = user.op
            if op == "fusion":
                inner = self.m.computations[user.called("calls")[0]]
                inner_params = inner.params()
                iroot = inner.root
                for idx, o in enumerate(user.operands):
                    if o != hlo.name:
                        continue
                    nested_seen = False
                    simple = not iroot.operands or inner_params[idx].name == iroot.operands[0]
                    for fu in comp.users.get(user.name, []):
                        if simple and fu.op == "slice":
                            size += fu.shape.xla_size()
                        elif simple and fu.op == "dynamic-slice":
                            if fu.operands[0] == user.name:
                                size += fu.shape.xla_size()
                            elif not nested_seen:
                                nested_seen = True
                                size += user.shape.xla_size()
                        elif simple and fu.op == "dynamic-update-slice":
                            if fu.operands[0] != user.name and not nested_seen:
                                nested_seen = True
                                size += user.shape.xla_size()
                        elif not nested_seen:
                            nested_seen = True
                            size += self.parameter_read(inner, inner_params[idx])
            elif op == "slice":
                size += user.shape.xla_size()
            elif op == "dynamic-slice":
                if user.operands[0] == hlo.name:
                    size += user.shape.xla_size()
                elif not seen:
                    seen = True
                    size += hlo.shape.xla_size()
            elif op == "dynamic-update-slice":
                if user.operands[0] != hlo.name and not seen:
                    seen = True
                    size += hlo.shape.xla_size()
            elif op in ("broadcast", "reshape"):
                size += hlo.shape.xla_size()
            elif not seen:
                seen = True
                size += hlo.shape.xla_size()
        return size


def hlo_bytes_accessed(hlo_text: str, mirror: bool = False) -> float:
    """Bytes read and written by one run of the compiled program ``hlo_text`` (per device for
    an SPMD program), counted as the module docstring says; ``mirror=True``: exactly what
    ``compiled.cost_analysis()["bytes accessed"]`` reports where the backend has one."""
    module = Module.parse(hlo_text)
    return Counter(module, mirror).computation(module.entry)


def hlo_bytes_notes(hlo_text: str) -> list[str]:
    """What the count had to assume (unknown trip counts, conditionals' largest branch)."""
    module = Module.parse(hlo_text)
    counter = Counter(module)
    counter.computation(module.entry)
    return sorted(counter.notes)


def breakdown(hlo_text: str, top: int) -> list[dict]:
    """The ``top`` instructions of the compiled program's entry computation by bytes read and
    written (as :func:`hlo_bytes_accessed` counts them; a ``while``, ``conditional`` or
    ``call`` is one row with what its computations move), each with its kind and JAX op name:
    where a step's traffic goes."""
    module = Module.parse(hlo_text)
    counter = Counter(module)
    comp = module.computations[module.entry]
    rows = []
    for ins in comp.instrs:
        if ins.op in FREE:
            continue
        where = re.search(r'op_name="([^"]*)"', ins.attrs)
        kind = re.search(r"kind=(\w+)", ins.attrs)
        shape = ins.line.split("=", 1)[1].strip().split(f" {ins.op}(", 1)[0]
        rows.append(dict(name=ins.name, op=ins.op if kind is None else f"{ins.op}:{kind.group(1)}",
                         bytes=counter.instruction(comp, ins), shape=shape[:80],
                         op_name=where.group(1)[-100:] if where else ""))  # fmt: skip
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]
