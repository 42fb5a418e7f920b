"""What ``jaxcomm bench`` measures: its ops, the compressors by name, sizes and the bus factor,
the configuration and one measured row."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")

_USER_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_compressor(name: str, factory: Callable[..., Any]) -> None:
    """Makes ``factory(**kwargs)`` available to the bench as ``name`` (overrides built-ins)."""
    _USER_REGISTRY[name.lower()] = factory


def compressor_registry() -> dict[str, Callable[..., Any]]:
    """Name -> constructor of every compressor the bench can use.

    Every concrete :class:`jaxcomm.Compressor` subclass exported by ``jaxcomm`` appears under its
    lower-cased class name (so compressors added to the library appear without editing the
    bench); ``none`` aliases ``NoCompression``; :func:`register_compressor` adds more.
    """
    import inspect

    import jaxcomm as jc

    registry: dict[str, Callable[..., Any]] = {}
    for name in getattr(jc, "__all__", dir(jc)):
        obj = getattr(jc, name, None)
        if (
            inspect.isclass(obj)
            and issubclass(obj, jc.Compressor)
            and obj is not jc.Compressor
            and not inspect.isabstract(obj)
        ):
            registry[name.lower()] = obj
    if "nocompression" in registry:
        registry["none"] = registry["nocompression"]
    registry.update(_USER_REGISTRY)
    return registry


_SPEC = re.compile(r"^\s*(?P<name>[A-Za-z_][\w-]*)\s*(?:\((?P<args>.*)\))?\s*$")


def make_compressor(spec: str) -> Any:
    """A compressor from ``"name"`` or ``"name(key=value, ...)"`` (values are Python literals)."""
    m = _SPEC.match(spec)
    registry = compressor_registry()
    if not m or m.group("name").lower() not in registry:
        raise ValueError(
            f"jaxcomm bench: unknown compressor {spec!r}; known: {', '.join(sorted(registry))} "
            "(keyword arguments as e.g. quantize(bits=4))"
        )
    kwargs: dict[str, Any] = {}
    if m.group("args") and m.group("args").strip():
        try:
            call = ast.parse(f"f({m.group('args')})", mode="eval").body
            assert isinstance(call, ast.Call) and not call.args
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        except (SyntaxError, ValueError, AssertionError) as e:
            raise ValueError(
                f"jaxcomm bench: compressor arguments must be key=literal pairs, got {spec!r}"
            ) from e
    try:
        return registry[m.group("name").lower()](**kwargs)
    except TypeError as e:
        raise ValueError(f"jaxcomm bench: cannot build compressor {spec!r}: {e}") from e


def registered_compressors() -> list[str]:
    """Names of the registered compressors that build without arguments (``none`` first)."""
    names = []
    for name, factory in compressor_registry().items():
        if name == "nocompression":
            continue  # listed as "none"
        try:
            factory()
        except (TypeError, ValueError):
            continue
        names.append(name)
    return sorted(names, key=lambda n: (n != "none", n))


def split_specs(text: str) -> list[str]:
    """Comma-separated items; commas inside parentheses stay: ``quantize(bits=4,block_size=64)``."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20}
_UNITS |= {"MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"64K"``, ``"16M"``, ``"1G"`` (binary units, like nccl-tests)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"jaxcomm bench: cannot read size {text!r} (e.g. 4096, 64K, 16M)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"jaxcomm bench: size must be positive, got {text!r}")
    return int(value)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of ``op`` on ``n`` devices (DeepSpeed ``ds_bench``, nccl-tests)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"jaxcomm bench: unknown op {op!r}; choose from {OPS}")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
      ops: subset of :data:`OPS`.
      compressors: compressor specs (see :func:`make_compressor`).
      sizes: message sizes in bytes (see the module docstring for what ``S`` is per op).
      repeats: timed calls per row (the median is reported).
      warmup: untimed calls per row after compiling.
      bucket_bytes: passed to the collectives (``None``: one bucket).
      devices: simulated CPU devices in-process (ignored when a backend already exists).
      seed: data seed.
      no_network: also time every row on one device alone (the ``compute`` column).
    """

    ops: tuple[str, ...] = OPS
    compressors: tuple[str, ...] = ("none", "onebit")
    sizes: tuple[int, ...] = (64 << 10, 1 << 20, 16 << 20)
    repeats: int = 5
    warmup: int = 1
    bucket_bytes: int | None = None
    devices: int = 8
    seed: int = 0
    no_network: bool = False

    def validate(self) -> BenchConfig:
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise ValueError(f"jaxcomm bench: unknown op(s) {bad}; choose from {OPS}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("jaxcomm bench: repeats must be >= 1 and warmup >= 0")
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError("jaxcomm bench: sizes must be positive")
        for spec in self.compressors:
            make_compressor(spec)
        return self


class BenchRow(NamedTuple):
    """One measurement. Bandwidths in bytes/s, time in seconds; see the module docstring."""

    op: str
    compressor: str
    devices: int
    size_bytes: int
    median_s: float
    algbw: float
    busbw: float
    wire_bytes: float
    wire_bw: float
    rel_error: float
    flags: str
    compute_s: float | None = None
