"""Step phases: a schedule's branches compiled as separate programs, chosen on the host.

The 1-bit optimizers follow a schedule of the step count: exact warm-up, then compressed steps
(``onebit_adam``, ``onebit_lamb``, ``compressed_mean``), 0/1 Adam's four kinds of step,
DiLoCo's inner and synchronising steps. Traced once, such a schedule is a ``lax.cond`` or
``lax.switch`` inside one program, and every step pays for it: XLA:CPU copies state that a
branch hands through, and the moments are then selected elementwise by phase, so every step
reads and writes buffers the phase it is in would not touch (measured in the README's "Train
step at 1 Gbit/s": a 0/1 Adam local step 159 -> 87 ms, a 1-bit Adam compressed step 209 ->
199 ms, on a 64 MiB MLP in two processes).

Tracing side (the optimizers): a schedule predicate goes through :func:`phase`, and the branch
through :func:`phase_cond` / :func:`phase_switch`. Outside a phase-specialised step they are
``lax.cond`` / ``lax.switch`` exactly (the default, nothing changes). Inside one,
:func:`phase` returns a Python ``bool`` / ``int`` and only that branch is traced.

Host side: ``jc.make_train_step(..., specialize_phases=True)`` returns a :class:`PhasedStep`.
Each call first runs a small *probe* (the step traced with :func:`phase` recording its values,
everything else dead code) on the input state, then the program compiled for those values (one
compile per distinct combination seen: 2 for a warm-up/compressed schedule, 3 for 1-bit Adam,
whose first compressed step moves its moments, up to 4 for 0/1 Adam). A value passed to
:func:`phase` should be a function of the state and hyperparameters only (the step count,
intervals): the probe is then a few scalar ops (one that reads the batch is still exact, but
the probe then runs the forward pass too). It must be the same on every device (checked on each
process's devices). The probe runs no host callbacks of jaxcomm's (:func:`recording_phases`).
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


class _Recording:
    """Collects the values :func:`phase` is given (the probe)."""

    def __init__(self) -> None:
        self.values: list[jax.Array] = []

    def take(self, value: jax.Array, cases: int) -> jax.Array:
        self.values.append(jnp.asarray(value, jnp.int32).reshape(()))
        return value

    def as_array(self) -> jax.Array:
        """The recorded values as one int32 vector (empty when the step has no phase)."""
        return jnp.stack(self.values) if self.values else jnp.zeros(0, jnp.int32)


class _Fixed:
    """Hands out the values the probe recorded, one per :func:`phase` call, in trace order."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values, self.position = tuple(int(v) for v in values), 0

    def take(self, value: jax.Array, cases: int) -> bool | int:
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


def phase(value: jax.Array, cases: int = 2) -> jax.Array | bool | int:
    """A schedule value (bool, or int in ``[0, cases)``) that a phase-specialised step fixes.

    Returns ``value`` itself unless the step being traced is specialised (see the module
    docstring), where it returns the value as a Python ``bool`` / ``int``, so that
    :func:`phase_cond` / :func:`phase_switch` trace one branch and ``jnp.where`` on it folds.
    ``value`` should depend on the state and hyperparameters only (see the module docstring),
    and must be the same on every device.

    Examples:
      >>> import jax.numpy as jnp, jaxcomm as jc
      >>> count = jnp.int32(3)
      >>> float(jc.phase_cond(jc.phase(count < 2), lambda x: x, lambda x: -x, jnp.float32(1)))
      -1.0
    """
    _check_value(value, cases)
    mode = getattr(_mode, "current", None)
    return value if mode is None else mode.take(value, cases)


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


class PhasedStep:
    """A train step compiled once per combination of phases, chosen on the host per call.

    ``traced(values, *args)`` is the step's function, traced under :func:`fixed_phases`
    (``values`` is a tuple of ints); ``probe(*args)`` a jittable function returning the phases
    of the step on these arguments as an int32 array (``(devices, phases)``; every row must
    agree; each process reads its own devices' rows). Made by
    ``jc.make_train_step(..., specialize_phases=True)``.

    Each call waits for its input state (the probe reads it), so the host does not run ahead
    of the device by more than one step. ``compile(fn, donate_argnums)`` turns a traced
    function into a program and ``compile_probe(probe)`` the probe (default ``jax.jit``;
    ``jax.pmap`` for ``jc.make_pmap_train_step``).
    """

    def __init__(
        self,
        traced: Callable,
        probe: Callable,
        *,
        donate_argnums: tuple[int, ...] = (),
        compile: Callable[[Callable, tuple[int, ...]], Callable] | None = None,
        compile_probe: Callable[[Callable], Callable] = jax.jit,
    ) -> None:
        self._traced, self._donate = traced, donate_argnums
        self._compile = compile or (lambda fn, donate: jax.jit(fn, donate_argnums=donate))
        self._probe = compile_probe(probe)
        self._programs: dict[tuple[int, ...], Callable] = {}
        self._without_phases = False  # set once a probe found no phase at all
        self._single: Callable | None = None  # the unspecialised program, for traced calls
        self.last_phases: tuple[int, ...] | None = None  #: the phases of the latest call

    def phases(self, *args) -> tuple[int, ...]:
        """The phase values of a step on ``args`` (runs the probe)."""
        if self._without_phases:
            return ()
        out = self._probe(*args)
        if out.shape[-1] == 0:
            self._without_phases = True
            return ()
        # This process's rows (a multi-process array is not fetched whole), (devices, phases).
        width = out.shape[-1]
        rows = np.concatenate(
            [np.asarray(s.data).reshape(-1, width) for s in out.addressable_shards]
        )
        if (rows != rows[0]).any():
            raise RuntimeError(
                f"jaxcomm: the devices disagree on the step's phases {rows.tolist()}: a phase "
                "must be the same on every device (a function of replicated state)"
            )
        return tuple(int(v) for v in rows[0])

    def program(self, values: tuple[int, ...]) -> Callable:
        """The jitted step for ``values`` (compiled on first use)."""
        if values not in self._programs:

            def fixed(*args, _values=values):
                with fixed_phases(_values):
                    return self._traced(*args)

            self._programs[values] = self._compile(fixed, self._donate)
        return self._programs[values]

    def __call__(self, *args):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            # Inside the caller's own trace (jax.jit, jc.comms_report) no phase can be read on
            # the host: the step is then the one program with every phase's branch.
            if self._single is None:
                self._single = self._compile(self._traced, self._donate)
            return self._single(*args)
        self.last_phases = self.phases(*args)
        return self.program(self.last_phases)(*args)

    def lower(self, *args):
        """``jax.jit(...).lower`` of the program for these arguments' phases."""
        return self.program(self.phases(*args)).lower(*args)

    @property
    def compiled_phases(self) -> list[tuple[int, ...]]:
        """The phase combinations compiled so far."""
        return list(self._programs)
