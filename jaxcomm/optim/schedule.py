"""Schedule phases, tracing side: a schedule's branches written so that a step can fix them.

The 1-bit optimizers follow a schedule of the step count: exact warm-up, then compressed steps
(``onebit_adam``, ``onebit_lamb``, ``compressed_mean``), 0/1 Adam's four kinds of step,
DiLoCo's inner and synchronising steps. Traced once, such a schedule is a ``lax.cond`` or
``lax.switch`` inside one program, and every step pays for it: XLA:CPU copies state that a
branch hands through and selects the moments elementwise by phase, so every step reads and
writes buffers its phase would not touch.

A schedule predicate goes through :func:`phase`, and the branch through :func:`phase_cond` /
:func:`phase_switch`. Outside a phase-specialised step they are ``lax.cond`` / ``lax.switch``
exactly (the default, nothing changes). Inside one (:class:`jaxcomm.train.phased.PhasedStep`,
the host side), :func:`phase` returns a Python ``bool`` / ``int`` and only that branch is
traced. The probe that reads the phases traces the step under :func:`record_phases`; each
phase's program under :func:`fixed_phases`. A value passed to :func:`phase` should be a
function of the state and hyperparameters only (the step count, intervals), and the same on
every device. The probe runs no host callbacks of jaxcomm's (:func:`recording_phases`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_mode = threading.local()


#: ``steady`` of a value that never changes again (int32's largest value).
STEADY_FOREVER = np.iinfo(np.int32).max


class _Recording:
    """Collects the values :func:`phase` is given, and for how many steps they hold (the
    probe)."""

    def __init__(self) -> None:
        self.values: list[jax.Array] = []
        self.steady: list[jax.Array] = []

    def take(self, value: jax.Array, cases: int, steady) -> jax.Array:
        self.values.append(jnp.asarray(value, jnp.int32).reshape(()))
        self.steady.append(jnp.asarray(0 if steady is None else steady, jnp.int32).reshape(()))
        return value

    def as_array(self) -> jax.Array:
        """One int32 vector: the recorded values, then the number of following steps for which
        all of them hold (the smallest ``steady``); empty when the step has no phase."""
        if not self.values:
            return jnp.zeros(0, jnp.int32)
        steady = jnp.maximum(jnp.min(jnp.stack(self.steady)), 0)
        return jnp.stack([*self.values, steady])


class _Fixed:
    """Hands out the values the probe recorded, one per :func:`phase` call, in trace order."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values, self.position = tuple(int(v) for v in values), 0

    def take(self, value: jax.Array, cases: int, steady) -> bool | int:
        if self.position >= len(self.values):
            raise RuntimeError(
                "jaxcomm: the step asked for more phases than its probe recorded: a phase "
                "must not depend on another phase's branch"
            )
        fixed = self.values[self.position]
        self.position += 1
        if not 0 <= fixed < cases:
            raise ValueError(f"jaxcomm: phase value {fixed} outside [0, {cases})")
        return bool(fixed) if jnp.result_type(value) == jnp.bool_ else fixed


def _check_value(value, cases: int) -> None:
    dtype = jnp.result_type(value)
    if jnp.shape(value) != () or not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(
            f"jaxcomm: a phase is a bool or integer scalar, got {dtype}{list(jnp.shape(value))}"
        )
    if isinstance(cases, bool) or not isinstance(cases, int) or cases < 1:
        raise ValueError(f"jaxcomm: phase cases must be a positive int, got {cases!r}")


def phase(
    value: jax.Array, cases: int = 2, *, steady: jax.Array | int | None = None
) -> jax.Array | bool | int:
    """A schedule value (bool, or int in ``[0, cases)``) that a phase-specialised step fixes.

    Returns ``value`` itself unless the step being traced is specialised (see the module
    docstring), where it returns the value as a Python ``bool`` / ``int``, so that
    :func:`phase_cond` / :func:`phase_switch` trace one branch and ``jnp.where`` on it folds.
    ``value`` should depend on the state and hyperparameters only (see the module docstring),
    and must be the same on every device.

    ``steady`` (optional, an int scalar, possibly traced): a number ``h`` of following steps
    over which ``value`` is sure not to change while the state changes only through this step
    (:data:`STEADY_FOREVER` for never again). A phase-specialised step then reads the phases
    once and runs the next ``h`` steps without reading them again, so the host does not wait
    for the device (e.g. for ``count < warmup`` with a count that grows by at most 1 a step:
    ``warmup - 1 - count`` while it holds, :data:`STEADY_FOREVER` once it does not). A wrong
    ``steady`` runs a step in the wrong phase: leave it out (0: read every step) when unsure.

    Examples:
      >>> import jax.numpy as jnp, jaxcomm as jc
      >>> count = jnp.int32(3)
      >>> float(jc.phase_cond(jc.phase(count < 2), lambda x: x, lambda x: -x, jnp.float32(1)))
      -1.0
    """
    _check_value(value, cases)
    mode = getattr(_mode, "current", None)
    return value if mode is None else mode.take(value, cases, steady)


def steady_below(count: jax.Array, boundary) -> jax.Array:
    """The ``steady`` of ``count < boundary`` for a count that grows by at most 1 a step: the
    steps left before it can turn false, then :data:`STEADY_FOREVER` (it stays false)."""
    count = jnp.asarray(count, jnp.int32)
    return jnp.where(count < boundary, boundary - 1 - count, STEADY_FOREVER).astype(jnp.int32)


def phase_cond(pred, true_fn: Callable, false_fn: Callable, *operands):
    """``lax.cond(pred, true_fn, false_fn, *operands)``; a Python ``bool`` ``pred`` (a fixed
    :func:`phase`) calls the one branch directly."""
    if isinstance(pred, bool | np.bool_):
        return (true_fn if pred else false_fn)(*operands)
    return lax.cond(pred, true_fn, false_fn, *operands)


def phase_switch(index, branches: Sequence[Callable], *operands):
    """``lax.switch(index, branches, *operands)``; a Python ``int`` ``index`` (a fixed
    :func:`phase`) calls the one branch directly (clamped like ``lax.switch``)."""
    if isinstance(index, int | np.integer) and not isinstance(index, bool):
        return branches[min(max(int(index), 0), len(branches) - 1)](*operands)
    return lax.switch(index, branches, *operands)


def recording_phases() -> bool:
    """Whether the step being traced is the probe (whose only outputs are the phases): code
    with side effects that the probe must not run (host callbacks) checks this."""
    return isinstance(getattr(_mode, "current", None), _Recording)


@contextlib.contextmanager
def _in_mode(mode) -> Iterator[Any]:
    previous = getattr(_mode, "current", None)
    _mode.current = mode
    try:
        yield mode
    finally:
        _mode.current = previous


def record_phases() -> contextlib.AbstractContextManager[_Recording]:
    """Trace under this to collect the phases (``with record_phases() as rec: ...``,
    then ``rec.values``)."""
    return _in_mode(_Recording())


class _Cases:
    """Collects each :func:`phase`'s number of cases, in trace order; the step stays the one
    program with every branch."""

    def __init__(self) -> None:
        self.cases: list[int] = []

    def take(self, value: jax.Array, cases: int, steady) -> jax.Array:
        self.cases.append(cases)
        return value


def phase_cases(fn: Callable, *args) -> tuple[int, ...]:
    """The ``cases`` of each :func:`phase` that ``fn(*args)`` asks for, in trace order (``fn``
    is traced with ``jax.eval_shape``; ``args`` may be ``jax.ShapeDtypeStruct``)."""
    with _in_mode(_Cases()) as mode:
        jax.eval_shape(fn, *args)
    return tuple(mode.cases)


@contextlib.contextmanager
def fixed_phases(values: Sequence[int]) -> Iterator[None]:
    """Trace under this to fix each :func:`phase` call, in order, to ``values``."""
    with _in_mode(_Fixed(values)) as mode:
        yield
    if mode.position != len(mode.values):
        raise RuntimeError(
            f"jaxcomm: the step asked for {mode.position} phases, its probe recorded "
            f"{len(mode.values)}"
        )
