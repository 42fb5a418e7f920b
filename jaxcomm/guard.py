"""The non-finite policy of jaxcomm, in one place.

A NaN or an Inf in a gradient, a mean or an update never reaches the state: the collectives
keep a bucket's error feedback when its result is not finite, and the optimizers skip the whole
step on every device (the state is kept, the update is zero). Three pieces, used by every
layer above this one:

* :func:`probes_finite`, the one finiteness test: exact (finite values whose sum would
  overflow are finite), one fused float reduction.
* :func:`keep_if`, the one keep-or-skip: the new tree where the verdict is true, else the old;
  :func:`all_of`, the verdicts of several parts as one.
* :class:`SkipCounters`, carried by every optimizer state: the steps skipped in a row
  (bounded by the optimizers' ``max_consecutive_skips``) and in all.
* :func:`skip_caps_on_host`: where that bound is checked. In the program by default (a
  conditional host callback); a train step that checks it on the host instead
  (``jc.make_train_step`` on GPU, where a conditional stops the host every step) traces the
  optimizer under it, returns the streaks and caps it collected as one small array, and
  :func:`raise_past_caps` reads them once the step is done.

Example:
  >>> import jax.numpy as jnp, jaxcomm as jc
  >>> ok = jc.guard.probes_finite([jnp.array([1.0, 3e38, 3e38])])  # the sum overflows
  >>> bool(ok)
  True
  >>> skips = jc.SkipCounters.zeros().after(jnp.array(False)).after(jnp.array(False))
  >>> int(skips.consecutive), int(skips.after(jnp.array(True)).total)
  (2, 2)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._compat import ensure_varying, same_trace


def probes_finite(probes: Iterable[Any]) -> jax.Array:
    """True iff every element of every array in ``probes`` is finite (bool scalar).

    Decided as ``isfinite(sum(x - x))``: ``x - x`` is 0 for a finite ``x`` and NaN for an Inf
    or a NaN, so the sum is exactly 0 or NaN (no false alarm, unlike ``sum(x)``), one fused
    float reduction. Integer arrays are finite and not read. (On XLA:CPU a boolean
    ``all(isfinite(x))`` writes a mask and reduces it in a tree, and ``x * 0`` can make XLA
    write a buffer of zeros first.)
    """
    total = jnp.zeros([], jnp.float32)
    for x in probes:
        if jnp.size(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            total = total + jnp.sum(x - x, dtype=jnp.float32)
    return jnp.isfinite(total)


def all_of(flags: Any) -> jax.Array:
    """The conjunction of a tree of bool scalars (true for an empty tree): one verdict from
    the verdicts of several buckets or parts of a step."""
    out = jnp.ones([], jnp.bool_)
    for flag in jax.tree.leaves(flags):
        out = out & flag
    return out


def keep_if(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old``, leaf by leaf (trees of the same structure)."""
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


class SkipCounters(NamedTuple):
    """The non-finite steps an optimizer skipped, in every jaxcomm optimizer's state
    (``state.skips``; DiLoCo counts its inner steps per device in ``state.local.skips`` and
    its outer steps in ``state.skips``).

    Attributes:
      consecutive: int32 scalar: steps skipped in a row up to now (0 after a step that was
        applied); the optimizers raise once it passes ``max_consecutive_skips``.
      total: int32 scalar: all steps skipped so far.
    """

    consecutive: jax.Array
    total: jax.Array

    @classmethod
    def zeros(cls) -> SkipCounters:
        """No step skipped yet."""
        return cls(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def after(self, ok: jax.Array) -> SkipCounters:
        """The counters after one more step, applied where ``ok`` (a bool), else skipped."""
        skipped = jnp.where(ok, 0, 1).astype(jnp.int32)
        return SkipCounters(
            jnp.where(ok, 0, self.consecutive + 1).astype(jnp.int32), self.total + skipped
        )


def too_many_skips(name: str, streak: int, cap: int) -> FloatingPointError:
    """The error of an optimizer ``name`` past its ``max_consecutive_skips`` (``cap``)."""
    return FloatingPointError(
        f"jaxcomm: {name} skipped {streak} consecutive steps whose gradients, mean or update "
        f"were not finite (max_consecutive_skips={cap}): the run is diverging or its data is "
        "bad; lower the learning rate, check the inputs, or resume from a checkpoint"
    )


class HostSkipCaps:
    """The skip caps met while one step was traced, for the host to check after it ran.

    Collects ``(streak, cap, name)`` from :func:`jaxcomm.optim` optimizers whose check runs at
    the step's own trace level (``like``: a value of that trace); one met anywhere else (in a
    ``lax.cond`` branch, under ``vmap``) keeps its check in the program.
    """

    def __init__(self, like: Any) -> None:
        self._like = like
        self._streaks: list[jax.Array] = []
        self._caps: list[jax.Array] = []
        self.names: list[str] = []

    def take(self, streak: jax.Array, cap: Any, name: str) -> bool:
        """Collect one cap; ``False`` (not collected) where it cannot leave the program."""
        if not same_trace(streak, self._like):
            return False
        if isinstance(cap, jax.core.Tracer) and not same_trace(cap, self._like):
            return False
        self._streaks.append(jnp.max(streak).astype(jnp.int32))
        self._caps.append(jnp.asarray(cap, jnp.int32))
        self.names.append(name)
        return True

    def report(self, axis_name: str | None) -> jax.Array:
        """``(1, caps, 2)`` int32, ``[..., 0]`` the streaks and ``[..., 1]`` the caps, typed
        varying over ``axis_name`` (``None``: untyped, under ``pmap``) for a per-device output."""
        pairs = [jnp.stack([s, c]) for s, c in zip(self._streaks, self._caps, strict=True)]
        rows = jnp.stack(pairs) if pairs else jnp.zeros((0, 2), jnp.int32)
        if axis_name is not None:
            rows = ensure_varying(rows, axis_name)
        return rows[None]


_host = threading.local()


@contextlib.contextmanager
def skip_caps_on_host(like: Any) -> Iterator[HostSkipCaps]:
    """Within: the optimizers' ``max_consecutive_skips`` checks traced at ``like``'s trace
    level are collected (:class:`HostSkipCaps`) instead of compiled into the program."""
    previous = getattr(_host, "current", None)
    _host.current = caps = HostSkipCaps(like)
    try:
        yield caps
    finally:
        _host.current = previous


def host_skip_caps() -> HostSkipCaps | None:
    """The collector of the step being traced, or ``None`` (checks stay in the program)."""
    return getattr(_host, "current", None)


def raise_past_caps(report: Any, names: Sequence[str]) -> None:
    """Raise :func:`too_many_skips` where a streak of ``report`` (a :meth:`HostSkipCaps.report`
    output of any devices, stacked on leading axes) is past its cap.

    Reads only this process's shards of a ``jax.Array`` (multi-process arrays are not fetched
    whole); every device of one process sees the same verdict where the streak is replicated.
    """
    shards = getattr(report, "addressable_shards", None)
    parts = [np.asarray(s.data) for s in shards] if shards is not None else [np.asarray(report)]
    rows = np.concatenate([p.reshape(-1, *p.shape[-2:]) for p in parts])
    for i in range(rows.shape[1]):
        streak, cap = int(rows[:, i, 0].max()), int(rows[:, i, 1].min())
        if streak > cap:
            name = names[i] if i < len(names) else "the optimizer"
            raise too_many_skips(name, streak, cap)
