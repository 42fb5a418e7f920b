"""Phase-specialised steps, host side: one program per combination of phases, chosen per call.

``jc.make_train_step(..., specialize_phases=True)`` (the default) wraps its step in a
:class:`PhasedStep`. Each call first runs a small *probe* (the step traced with
:func:`jaxcomm.optim.schedule.phase` recording its values, everything else dead code) on the
input state, then the program compiled for those values (one compile per distinct combination
seen: 2 for a warm-up/compressed schedule, 3 for 1-bit Adam, whose first compressed step moves
its moments, up to 4 for 0/1 Adam). A phase that is a function of the state and
hyperparameters makes the probe a few scalar ops (one that reads the batch is still exact, but
the probe then runs the forward pass too). It must be the same on every device (checked on
each process's devices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxcomm.optim.schedule import STEADY_FOREVER, fixed_phases


class PhasedStep:
    """A train step compiled once per combination of phases, chosen on the host per call.

    ``traced(values, *args)`` is the step's function, traced under :func:`fixed_phases`
    (``values`` is a tuple of ints); ``probe(*args)`` a jittable function returning the phases
    of the step on these arguments as an int32 array (``(devices, phases)``; every row must
    agree; each process reads its own devices' rows). Made by
    ``jc.make_train_step(..., specialize_phases=True)``.

    A call reads the phases of its input state (the probe waits for it), unless the state is
    the output of the previous call and the phases read last are sure to hold for it (the
    ``steady`` of :func:`jaxcomm.phase`): the 1-bit optimizers' schedules say so for the rest
    of the warm-up and for every step after it, so their steps then queue without the host
    waiting for the device. ``compile(fn, donate_argnums)`` turns a traced
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
        # The state the latest call returned, and for how many more calls its phases hold.
        self._last_output: Any = None
        self._steady = 0

    def phases(self, *args) -> tuple[int, ...]:
        """The phase values of a step on ``args`` (runs the probe)."""
        return self._read(*args)[0]

    def _read(self, *args) -> tuple[tuple[int, ...], int]:
        """The phases of a step on ``args`` and the number of following steps they hold for."""
        if self._without_phases:
            return (), STEADY_FOREVER
        out = self._probe(*args)
        if out.shape[-1] == 0:
            self._without_phases = True
            return (), STEADY_FOREVER
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
        return tuple(int(v) for v in rows[0, :-1]), int(rows[0, -1])

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
        if self._steady > 0 and args[0] is self._last_output:
            self._steady -= 1  # the phases read earlier hold: no wait for the device
        else:
            self.last_phases, self._steady = self._read(*args)
        out = self.program(self.last_phases)(*args)
        self._last_output = out[0]
        return out

    def lower(self, *args):
        """``jax.jit(...).lower`` of the program for these arguments' phases."""
        return self.program(self.phases(*args)).lower(*args)

    @property
    def compiled_phases(self) -> list[tuple[int, ...]]:
        """The phase combinations compiled so far."""
        return list(self._programs)
