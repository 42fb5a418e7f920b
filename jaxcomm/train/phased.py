"""Phase-specialised steps, host side: one program per combination of phases, chosen per call.

``jc.make_train_step(..., specialize_phases=True)`` (the default) wraps its step in a
:class:`PhasedStep`. Each call first runs a small *probe* (the step traced with
:func:`jaxcomm.optim.schedule.phase` recording its values, everything else dead code) on the
input state, then the program compiled for those values (2 programs for a warm-up/compressed
schedule, 3 for 1-bit Adam, whose first compressed step moves its moments, up to 4 for 0/1
Adam). A phase that is a function of the state and hyperparameters makes the probe a few
scalar ops (one that reads the batch is still exact, but the probe then runs the forward pass
too). It must be the same on every device (checked on each process's devices).

**Compiling ahead.** By default the first call compiles every program the schedule can reach
before it runs (:meth:`PhasedStep.compile_all`, also callable before the first batch), so that
no later step stops to compile. Which combinations are reachable is found on the host: when
the probe reads no state but step counts (leaves named ``count``: ``jc.onebit_lamb``,
``jc.compressed_mean``, ``jc.diloco``), it is evaluated on the state with its counts advanced
through the schedule (exact); when it reads other state (``jc.onebit_adam``'s
``preconditioned``, ``jc.zero_one_adam``'s intervals), every combination of the phases' values
is compiled (a superset: ``jc.onebit_adam`` reaches all 3 of its kinds; ``jc.zero_one_adam``
reaches its 4 when the variance is refreshed at intervals and the local steps grow past one).
A step skipped for a non-finite gradient that holds its count only repeats a state, so it
reaches no other combination.

The compiles happen on the first call, not in a background thread: a schedule can change
phase a few steps in (``freeze_step``; 0/1 Adam's first variance interval ends at step 16),
a fraction of a second into a run, while one compile of a phase program takes as long as a
hundred steps or more (0/1 Adam on an H200: 1.4-2.9 s a compile, 4-12 ms a step,
``benchmarks/results/gpu_h200_one_device.md``), so a background compile would rarely be done
in time and that step would wait for it anyway, at a point the user did not choose. The first
call pays the same compiles once, before any step runs: the programs are traced in the calling
thread, then compiled in parallel threads (XLA compiles without holding the GIL).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The dependency analysis of the probe (which inputs it reads) and its evaluation on them.
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe

from jaxcomm.optim.schedule import STEADY_FOREVER, fixed_phases, phase_cases

#: The most phase combinations :meth:`PhasedStep.compile_all` compiles when it cannot follow
#: the schedule (a probe that reads more than step counts): beyond it, each compiles when seen.
MAX_UNFOLLOWED_COMBINATIONS = 64
#: With no ``steps`` given, how many steps past the last new combination a schedule of step
#: counts is followed before :meth:`PhasedStep.compile_all` concludes it has seen them all
#: (periodic schedules, e.g. DiLoCo's syncs, repeat well within it; the horizon doubles with
#: the step of the last new combination).
LOOKAHEAD_STEPS = 1024


def _is_count(path, leaf) -> bool:
    """A step count: an integer leaf named ``count`` (optax's and jaxcomm's states)."""
    last = path[-1] if path else None
    name = getattr(last, "name", getattr(last, "key", None))
    return name == "count" and jnp.issubdtype(jnp.result_type(leaf), jnp.integer)


def _compile_ahead(program: Any, args: tuple) -> None:
    """Compiles a ``jax.jit`` function for ``args``; its calls on arguments like these then
    find the executable in JAX's cache (``jax.pmap``'s calls do not)."""
    program.lower(*args).compile()


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

    With ``precompile`` (the default) the first call runs :meth:`compile_all` on its
    arguments before the step, unless it was called already; ``False`` compiles each program
    when a step first needs it. ``compile_count`` is the number of programs compiled so far.
    """

    #: Threads :meth:`compile_all` compiles the lowered programs in (``None``: one per program,
    #: at most one per CPU core).
    compile_threads: int | None = None

    def __init__(
        self,
        traced: Callable,
        probe: Callable,
        *,
        donate_argnums: tuple[int, ...] = (),
        compile: Callable[[Callable, tuple[int, ...]], Callable] | None = None,
        compile_probe: Callable[[Callable], Callable] = jax.jit,
        precompile: bool = True,
    ) -> None:
        if not isinstance(precompile, bool):
            raise TypeError(f"jaxcomm: precompile is a bool, got {precompile!r}")
        self._traced, self._donate = traced, donate_argnums
        self._compile = compile or (lambda fn, donate: jax.jit(fn, donate_argnums=donate))
        # The probe's program; _probe is what a call runs (the same, unless replaced).
        self._probe = self._probe_program = compile_probe(probe)
        self._programs: dict[tuple[int, ...], Callable] = {}
        self._without_phases = False  # set once a probe found no phase at all
        self._single: Callable | None = None  # the unspecialised program, for traced calls
        self.last_phases: tuple[int, ...] | None = None  #: the phases of the latest call
        # The state the latest call returned, and for how many more calls its phases hold.
        self._last_output: Any = None
        self._steady = 0
        self.precompile = precompile
        self._precompiled = False  # compile_all has run
        self._probe_compiled = False
        #: Programs compiled so far: the probe, one per phase combination (ahead of time or
        #: when first run), the unspecialised one if a traced call needed it. Recompiles of a
        #: program for other shapes or shardings are not counted.
        self.compile_count = 0
        #: Seconds spent in :meth:`compile_all` (finding the combinations, tracing, compiling).
        self.compile_seconds = 0.0

    def phases(self, *args) -> tuple[int, ...]:
        """The phase values of a step on ``args`` (runs the probe)."""
        return self._read(*args)[0]

    def _read(self, *args) -> tuple[tuple[int, ...], int]:
        """The phases of a step on ``args`` and the number of following steps they hold for."""
        if self._without_phases:
            return (), STEADY_FOREVER
        if not self._probe_compiled:
            self._probe_compiled = True
            self.compile_count += 1  # compiled by this call
        out = self._probe(*args)
        if out.shape[-1] == 0:
            self._without_phases = True
            return (), STEADY_FOREVER
        return self._decode(out)

    @staticmethod
    def _decode(out: jax.Array) -> tuple[tuple[int, ...], int]:
        """A probe's output as (phases, steady), from this process's rows (a multi-process
        array is not fetched whole), ``(devices, phases + 1)``."""
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
            self.compile_count += 1  # now by compile_all, else by the call that needs it
        return self._programs[values]

    def __call__(self, *args):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            # Inside the caller's own trace (jax.jit, jc.comms_report) no phase can be read on
            # the host: the step is then the one program with every phase's branch.
            if self._single is None:
                self._single = self._compile(self._traced, self._donate)
                self.compile_count += 1
            return self._single(*args)
        if self.precompile and not self._precompiled:
            self.compile_all(*args)
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

    # -- compiling ahead of time -----------------------------------------------------------

    def compile_all(self, *args, steps: int | None = None) -> list[tuple[int, ...]]:
        """Compiles the probe and the program of every phase combination reachable from
        ``args`` (see :meth:`reachable_phases`), so that no step compiles later.

        ``args`` are the step's arguments: the state itself (its counts are read), the rest
        arrays or ``jax.ShapeDtypeStruct`` with the shardings the step will get. Programs
        already compiled are not compiled again. Returns the combinations compiled for.
        """
        start = time.perf_counter()
        if not self._probe_compiled:
            _compile_ahead(self._probe_program, args)
            self._probe_compiled = True
            self.compile_count += 1
        combinations = self.reachable_phases(*args, steps=steps)
        # Traced and lowered here, under the caller's thread-local contexts (JAX's config and
        # mesh, jaxcomm's), then compiled in threads: XLA compiles without holding the GIL.
        lowered = [
            self.program(v).lower(*args)  # type: ignore[attr-defined]
            for v in combinations
            if v not in self._programs
        ]
        workers = max(1, min(len(lowered), self.compile_threads or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda program: program.compile(), lowered))
        self._precompiled = True
        self.compile_seconds += time.perf_counter() - start
        return combinations

    def reachable_phases(self, *args, steps: int | None = None) -> list[tuple[int, ...]]:
        """The phase combinations a run from ``args`` can reach.

        Exact when the probe reads no state but step counts (integer leaves named ``count``,
        each growing by one a step): the probe is evaluated on the state with every count
        advanced by ``k``, ``k`` jumping by each read's ``steady``, until the phases hold for
        good, ``k`` reaches ``steps`` (the run's remaining steps, when given), or, without
        ``steps``, :data:`LOOKAHEAD_STEPS` steps pass beyond twice the step of the last new
        combination. Otherwise every combination of the phases' values (a superset, with a
        warning and none at all beyond :data:`MAX_UNFOLLOWED_COMBINATIONS`).
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
            raise TypeError(f"jaxcomm: steps is an int or None, got {steps!r}")
        if steps is not None and steps < 1:
            raise ValueError(f"jaxcomm: steps must be >= 1, got {steps}")
        closed = jax.make_jaxpr(self._probe_program)(*args)
        (out_aval,) = closed.out_avals
        if out_aval.shape[-1] == 0:
            self._without_phases = True
            return [()]
        # Which of the probe's inputs (constants first) it reads.
        jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
        jaxpr, used = pe.dce_jaxpr(jaxpr, [True])
        flat = jax.tree_util.tree_flatten_with_path(args)[0]
        inputs = [(None, c) for c in closed.consts] + list(flat)
        read = [(path, x) for (path, x), u in zip(inputs, used, strict=True) if u]
        counts = [path is not None and _is_count(path, x) for path, x in read]
        if not all(c or path is None for c, (path, _) in zip(counts, read, strict=True)):
            return self._every_combination(*args)
        abstract = [
            jax.tree_util.keystr(path or ())
            for path, x in read
            if isinstance(x, jax.ShapeDtypeStruct)
        ]
        if abstract:
            raise TypeError(
                f"jaxcomm: compile_all reads the step counts from the state: pass the state "
                f"itself, not its shapes ({', '.join(abstract)})"
            )

        @jax.jit
        def advanced(k, *values):
            values = [
                x + k.astype(x.dtype) if c else x for x, c in zip(values, counts, strict=True)
            ]
            return jax_core.eval_jaxpr(jaxpr, (), *values)[0]

        values = [x for _, x in read]
        self.compile_count += 1
        found: dict[tuple[int, ...], None] = {}
        k = last_new = 0
        while True:
            phases, held = self._decode(advanced(np.int32(k), *values))
            if phases not in found:
                found[phases] = None
                last_new = k
            if held >= STEADY_FOREVER:
                break
            k += held + 1
            horizon = steps if steps is not None else 2 * last_new + LOOKAHEAD_STEPS
            if k >= min(horizon, 2**30):
                break
        return list(found)

    def _every_combination(self, *args) -> list[tuple[int, ...]]:
        # A new function, so that no trace cached for the step itself is reused.
        cases = phase_cases(self._compile(lambda *a: self._traced(*a), ()), *args)
        total = math.prod(cases)
        if total > MAX_UNFOLLOWED_COMBINATIONS:
            warnings.warn(
                f"jaxcomm: the step's {len(cases)} phases read more state than step counts, "
                f"and their {total} combinations are too many to compile ahead: each "
                "compiles when a step first needs it",
                stacklevel=3,
            )
            return []
        return list(itertools.product(*(range(c) for c in cases)))
