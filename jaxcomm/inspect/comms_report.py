"""``jc.comms_report``: what a program asked to communicate against what XLA compiled.

The requested side walks the jaxpr (:func:`requested_collectives`); the compiled side reads the
HLO (:mod:`jaxcomm.inspect.hlo`). A report flags collectives that XLA widened (e.g. a compressed
payload that became f32) or that appeared without being asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from jaxcomm.inspect.hlo import DTYPE_BYTES, CollectiveOp, collectives_in_hlo, num_devices

# Map from jaxpr collective primitives to the HLO opcode they lower to.
_PRIMITIVE_OPS = (
    ("reduce_scatter", "reduce-scatter"),
    ("psum_scatter", "reduce-scatter"),
    ("all_gather", "all-gather"),
    ("all_to_all", "all-to-all"),
    ("ppermute", "collective-permute"),
    ("psum", "all-reduce"),
    ("pmax", "all-reduce"),
    ("pmin", "all-reduce"),
)

_HLO_DTYPE = {
    "bool": "pred", "int8": "s8", "uint8": "u8", "int16": "s16", "uint16": "u16",
    "int32": "s32", "uint32": "u32", "int64": "s64", "uint64": "u64", "float16": "f16",
    "bfloat16": "bf16", "float32": "f32", "float64": "f64", "int4": "s4", "uint4": "u4",
    "complex64": "c64", "complex128": "c128", "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}  # fmt: skip


def _hlo_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return _HLO_DTYPE.get(name, name)


def _width(hlo_dtype: str) -> float:
    return DTYPE_BYTES.get(hlo_dtype, 0)


def requested_collectives(jaxpr: Any) -> dict[str, set[str]]:
    """HLO opcode -> dtypes (HLO names) of the collectives a (closed) jaxpr asks for.

    Walks every sub-jaxpr (``jit``, ``shard_map``, ``pmap``, control flow). This is what the
    program *requested*; the compiled HLO says what XLA *runs*.
    """
    from jax.extend import core as jex_core

    found: dict[str, set[str]] = {}

    def sub_jaxprs(params: dict) -> list:
        out = []
        for value in params.values():
            for v in value if isinstance(value, tuple | list) else (value,):
                if isinstance(v, jex_core.ClosedJaxpr):
                    out.append(v.jaxpr)
                elif isinstance(v, jex_core.Jaxpr):
                    out.append(v)
        return out

    def walk(jp) -> None:
        for eqn in jp.eqns:
            name = eqn.primitive.name
            for prefix, op in _PRIMITIVE_OPS:
                if name.startswith(prefix):
                    for var in eqn.invars:
                        aval = getattr(var, "aval", None)
                        if aval is not None and hasattr(aval, "dtype"):
                            found.setdefault(op, set()).add(_hlo_dtype(aval.dtype))
                    break
            for sub in sub_jaxprs(eqn.params):
                walk(sub)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return found


class CommsRow(NamedTuple):
    """Collectives of one kind and payload dtype in a compiled program.

    Attributes:
      op: HLO opcode (``all-reduce``, ``all-to-all``, ...).
      dtype: payload element type(s), ``+``-joined for tuple-shaped collectives.
      count: how many such instructions the program runs.
      payload_bytes: their payload bytes, summed (operand bytes; gathered bytes for all-gather).
      wire_bytes: bytes each device sends for them under the ring/pairwise model, summed.
      flag: why this row is suspicious, or ``""``.
    """

    op: str
    dtype: str
    count: int
    payload_bytes: int
    wire_bytes: float
    flag: str


@dataclass(frozen=True)
class CommsReport:
    """What a compiled function sends, per collective kind and dtype; see :func:`comms_report`.

    Attributes:
      rows: one :class:`CommsRow` per (op, dtype), in order of first appearance.
      ops: every collective instruction, in program order.
      requested: op -> dtypes the traced program asked for (from its jaxpr).
      expect: the payload dtype the caller expected, if given.
      num_devices: devices the program was compiled for.
    """

    rows: tuple[CommsRow, ...]
    ops: tuple[CollectiveOp, ...]
    requested: dict[str, frozenset[str]]
    expect: str | None
    num_devices: int

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends for one run of the program."""
        return sum(r.wire_bytes for r in self.rows)

    @property
    def flagged(self) -> tuple[CommsRow, ...]:
        """The rows with a flag: widened or wider than expected payloads."""
        return tuple(r for r in self.rows if r.flag)

    @property
    def ok(self) -> bool:
        """True when no collective is flagged."""
        return not self.flagged

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "num_devices": self.num_devices,
            "expect": self.expect,
            "wire_bytes": self.wire_bytes,
            "rows": [r._asdict() for r in self.rows],
        }

    def __str__(self) -> str:
        head = f"{'op':<20}{'dtype':<10}{'count':>6}{'payload B':>14}{'wire B/device':>16}  flag"
        lines = [
            f"collectives of the compiled program ({self.num_devices} devices; "
            f"bytes per run, ring/pairwise model)",
            head,
        ]
        for r in self.rows:
            mark = f"!! {r.flag}" if r.flag else "ok"
            lines.append(
                f"{r.op:<20}{r.dtype:<10}{r.count:>6}{r.payload_bytes:>14,}"
                f"{r.wire_bytes:>16,.0f}  {mark}"
            )
        total = f"{'total':<30}{sum(r.count for r in self.rows):>6}{'':>14}"
        lines.append(f"{total}{self.wire_bytes:>16,.0f}")
        n_bad = len(self.flagged)
        lines.append(f"{n_bad} collective kind(s) flagged" if n_bad else "no widened payloads")
        return "\n".join(lines)


def _flag(
    op: CollectiveOp,
    requested: dict[str, set[str]],
    expect: str | None,
    small_bytes: int,
) -> str:
    widest = max((_width(d) for d in op.dtypes), default=0)
    wide = [d for d in op.dtypes if _width(d) == widest]
    # The same op kind if the program asked for it; else any (XLA may rewrite one into another).
    asked = (requested.get(op.op) or set().union(*requested.values())) if requested else set()
    if asked and not set(op.dtypes) <= asked:
        asked_width = max(_width(d) for d in asked)
        if widest > asked_width:
            return f"widened by XLA: program asked for {'/'.join(sorted(asked))}"
    if expect is not None and op.payload_bytes > small_bytes:
        if widest > _width(expect) and any(d[0] in "fbc" for d in wide):
            return f"wider than the expected {expect} payload"
    return ""


def report_from_hlo(
    text: str,
    requested: dict[str, set[str]] | None = None,
    *,
    expect: Any = None,
    small_bytes: int = 4096,
) -> CommsReport:
    """:class:`CommsReport` of HLO text; ``requested`` as from :func:`requested_collectives`."""
    expect_name = None if expect is None else _hlo_dtype(expect)
    if expect_name is not None and expect_name not in DTYPE_BYTES:
        raise ValueError(f"jaxcomm.inspect: unknown expected dtype {expect!r}")
    requested = requested or {}
    ops = collectives_in_hlo(text)
    groups: dict[tuple[str, str], list] = {}
    for o in ops:
        key = (o.op, "+".join(o.dtypes))
        flag = _flag(o, requested, expect_name, small_bytes)
        row = groups.setdefault(key, [0, 0, 0.0, ""])
        row[0] += 1
        row[1] += o.payload_bytes
        row[2] += o.wire_bytes
        row[3] = row[3] or flag
    rows = tuple(CommsRow(op, dt, c, p, w, f) for (op, dt), (c, p, w, f) in groups.items())
    return CommsReport(
        rows=rows,
        ops=tuple(ops),
        requested={k: frozenset(v) for k, v in requested.items()},
        expect=expect_name,
        num_devices=num_devices(text),
    )


def comms_report(
    fn: Callable, *args: Any, expect: Any = None, small_bytes: int = 4096, **kwargs: Any
) -> CommsReport:
    """Every collective ``fn`` runs once compiled for ``args``, with dtype, count and wire bytes.

    ``fn`` is compiled (not run: arrays or ``jax.ShapeDtypeStruct``s both work) and its HLO read,
    so this costs nothing at run time, unlike a logger that times and blocks on each op. Rows are
    grouped by (op, dtype); a row is flagged when

    * XLA widened the payload: the compiled collective's dtype is wider than any dtype the traced
      program asked for on that op (e.g. a ``bf16`` ``psum`` that runs as ``f32`` after XLA
      moved a convert across it), or
    * ``expect`` is given (the dtype a compressor should send, e.g. ``"uint8"`` for 1-bit signs,
      ``"int8"``) and a floating collective moves more than ``small_bytes`` in a wider dtype
      (scales and norms are small; a payload that grows with the input is not).

    Print the report for a table; ``report.ok`` is ``False`` when anything is flagged.

    Any mesh works, JAX's default ``jax.make_mesh(...)`` (Explicit axes) as well as an Auto
    mesh, with the same rows and bytes: ``fn`` is lowered as it would run. On an Explicit mesh
    the arguments must say where they live, as the program itself needs: arrays placed with
    ``jax.device_put(x, NamedSharding(mesh, spec))``, or shape structs given the same
    ``sharding=`` (a ``shard_map`` refuses an input whose sharding does not match its
    ``in_specs``; an Auto mesh reshards it silently).
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    text = jitted.lower(*args, **kwargs).compile().as_text()
    requested = requested_collectives(jax.make_jaxpr(jitted)(*args, **kwargs))
    return report_from_hlo(text, requested, expect=expect, small_bytes=small_bytes)
