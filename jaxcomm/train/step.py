"""The train step users call: places the batch and bounds how many steps run ahead."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax

from jaxcomm.phases import PhasedStep

PyTree = Any

#: Steps a :class:`TrainStep` lets the host dispatch ahead of the device by default.
DEFAULT_MAX_IN_FLIGHT = 2


class TrainStep:
    """``step(state, batch) -> (state, metrics)``, built by ``jc.make_train_step``.

    Each call places ``batch`` (see :func:`jaxcomm.train.place_batch`), runs the compiled step,
    and, once more than ``max_in_flight`` steps are queued, waits for the oldest one's metrics
    before returning. A loop that never reads a value thus cannot queue hundreds of steps
    (XLA:CPU aborts when collectives wait in its queue past its rendezvous timeout), and the
    device never idles for the host while the bound is two or more steps.

    A phase-specialised step (the default: one program per phase of the optimizer's schedule,
    :class:`jaxcomm.phases.PhasedStep`) reads the phase of its input state first, so it runs at
    most one step ahead whatever the bound; ``step.phased`` is that object (``None`` for a
    single program), ``step.lower(state, batch)`` the lowering of the program this state runs.
    """

    def __init__(
        self,
        program: Callable,
        place: Callable[[PyTree], PyTree],
        *,
        max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight is not None and (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise ValueError(
                f"jaxcomm: max_in_flight is a positive int or None, got {max_in_flight!r}"
            )
        self._program, self._place = program, place
        self.max_in_flight = max_in_flight
        self._queued: collections.deque = collections.deque()

    @property
    def phased(self) -> PhasedStep | None:
        """The :class:`jaxcomm.phases.PhasedStep` behind this step, or ``None``."""
        return self._program if isinstance(self._program, PhasedStep) else None

    def __call__(self, state: PyTree, batch: PyTree):
        new_state, metrics = self._program(state, self._place(batch))
        if self.max_in_flight is not None:
            self._queued.append(jax.tree.leaves(metrics)[0])
            while len(self._queued) > self.max_in_flight:
                jax.block_until_ready(self._queued.popleft())
        return new_state, metrics

    def lower(self, state: PyTree, batch: PyTree):
        """``jax.jit(...).lower`` of the program that ``step(state, batch)`` would run."""
        return self._program.lower(state, self._place(batch))

    # The phase-specialised step's inspection API, where there is one.
    def _need_phased(self) -> PhasedStep:
        if self.phased is None:
            raise AttributeError("jaxcomm: this step is one program (specialize_phases=False)")
        return self.phased

    def phases(self, state: PyTree, batch: PyTree) -> tuple[int, ...]:
        """The phase values ``step(state, batch)`` would run with."""
        return self._need_phased().phases(state, self._place(batch))

    def program(self, values: tuple[int, ...]) -> Callable:
        """The jitted program of one phase combination (takes a placed batch)."""
        return self._need_phased().program(values)

    @property
    def last_phases(self) -> tuple[int, ...] | None:
        return self._need_phased().last_phases

    @property
    def compiled_phases(self) -> list[tuple[int, ...]]:
        return self._need_phased().compiled_phases
