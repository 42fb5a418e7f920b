"""The train steps: ``make_train_step`` (``shard_map``), ``make_pmap_train_step`` (``pmap``),
and :class:`TrainStep`, the step users call (places the batch, bounds the steps in flight).

Both builders return a step ``step(state, batch) -> (state, metrics)`` and its initial
:class:`jaxcomm.TrainState` (in the layouts of :mod:`jaxcomm.train.layout`), and take the same
*global* batch (every leaf's leading axis is split over the devices). The transformation
receives each device's **local** gradients and does the communication (``jc.compressed_mean``,
``jc.onebit_adam``, ``jc.zero_one_adam``, or your own); for exact data parallelism chain
``jc.compressed_mean(axis, jc.NoCompression())`` in front of any optax optimizer. Under
``shard_map`` the step takes gradients with respect to a device-varying copy of the
parameters, so JAX inserts no implicit fp32 ``psum`` of the gradients (which it otherwise does
for replicated inputs); a transformation that returns device-varying updates for replicated
parameters is refused at trace time by ``check_vma`` instead of silently diverging.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm._compat import GPU_PLATFORMS, ensure_varying
from jaxcomm.comm.axes import canonical_axis, mesh_axis_sizes
from jaxcomm.guard import raise_past_caps, skip_caps_on_host
from jaxcomm.optim.diloco.background import BackgroundSync, background_update
from jaxcomm.optim.schedule import record_phases
from jaxcomm.train.layout import (
    TrainState,
    global_view,
    init_opt_state,
    initial_train_state,
    local_view,
    params_are_per_device,
    repeat,
    train_state_specs,
)
from jaxcomm.train.local_step import local_train_step
from jaxcomm.train.phased import PhasedStep
from jaxcomm.train.placement import place_batch

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
    :class:`jaxcomm.train.phased.PhasedStep`) reads the phases of its input state where they
    may have changed (then it waits for that state; the 1-bit optimizers' phases are known for
    the rest of the warm-up and for good after it); ``step.phased`` is that object (``None`` for
    a single program), ``step.lower(state, batch)`` the lowering of the program this state runs.

    Where the optimizers' ``max_consecutive_skips`` is checked on the host (``skip_names`` not
    ``None``; ``jc.make_train_step`` on GPU), each program returns a third output, the skip
    streaks and caps, which a call checks once its step is done: a run past the cap raises
    ``FloatingPointError`` from a later call (at most ``max_in_flight`` later), or from
    :meth:`check_skips`.
    """

    def __init__(
        self,
        program: Callable,
        place: Callable[[PyTree], PyTree],
        *,
        max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
        background: BackgroundSync | None = None,
        place_abstract: Callable[[PyTree], PyTree] | None = None,
        precompile: bool = False,
        skip_names: list[str] | None = None,
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
        self.background = background  # runs jc.diloco(background=True)'s syncs
        self._place_abstract = place_abstract  # a batch of jax.ShapeDtypeStruct, placed
        # The background sync's programs still to compile before the first step runs.
        self._sync_programs_pending = precompile and background is not None
        # Host-checked skip caps: the optimizers' names (filled in when a program is traced)
        # and the reports of the steps not checked yet.
        self._skip_names = skip_names
        self._reports: collections.deque = collections.deque()

    @property
    def phased(self) -> PhasedStep | None:
        """The :class:`jaxcomm.train.phased.PhasedStep` behind this step, or ``None``."""
        return self._program if isinstance(self._program, PhasedStep) else None

    def __call__(self, state: PyTree, batch: PyTree):
        # (only where the caps leave the program: the walk over the state costs every call)
        if self._skip_names is not None and any(
            isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, batch))
        ):
            # Traced inside the caller's own jit: no step of it is done before the caller's
            # program ends, so its skip caps stay in that program.
            with _caps_in_program():
                return self._call(state, batch)
        return self._call(state, batch)

    def _call(self, state: PyTree, batch: PyTree):
        if self.background is None:
            new_state, metrics, *report = self._program(state, self._place(batch))
        else:
            if self._sync_programs_pending:
                self.background.compile_all(state)
                self._sync_programs_pending = False
            state = self.background.before(state)
            new_state, metrics, *report = self._program(state, self._place(batch))
            self.background.after(new_state)
        # (pmap's step traced by its caller still returns its report: a tracer, not checkable)
        self._reports.extend(r for r in report if not isinstance(r, jax.core.Tracer))
        if self.max_in_flight is not None:
            self._queued.append(jax.tree.leaves(metrics)[0])
            while len(self._queued) > self.max_in_flight:
                jax.block_until_ready(self._queued.popleft())
        self.check_skips(wait=False)
        return new_state, metrics

    def check_skips(self, *, wait: bool = True) -> None:
        """Raise ``FloatingPointError`` if a step run so far skipped more non-finite steps in a
        row than its optimizer's ``max_consecutive_skips``, where the host checks it (see
        above; elsewhere the program raises itself). ``wait``: wait for the steps still
        running (the end of a loop); ``False``: check only those already done (each call)."""
        while self._reports and (wait or self._reports[0].is_ready()):
            raise_past_caps(self._reports.popleft(), self._skip_names or ())

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
        """The jitted program of one phase combination (takes a placed batch; returns
        ``(state, metrics)``, and the skip report where the host checks the skip caps)."""
        return self._need_phased().program(values)

    @property
    def last_phases(self) -> tuple[int, ...] | None:
        return self._need_phased().last_phases

    @property
    def compiled_phases(self) -> list[tuple[int, ...]]:
        return self._need_phased().compiled_phases

    def compile_all(
        self, state: PyTree, batch: PyTree, *, steps: int | None = None
    ) -> list[tuple[int, ...]]:
        """Compiles every program a run from ``state`` will need, before the first batch.

        ``batch`` is a global batch or its shapes (``jax.ShapeDtypeStruct`` leaves, placed as
        a batch would be); ``state`` the state itself (its step counts are read). A
        phase-specialised step compiles its probe and every phase combination its schedule
        can reach (:meth:`jaxcomm.train.phased.PhasedStep.compile_all`; ``steps``: how many
        steps the run has left, when known), which its first call otherwise does itself; a
        single program compiles that program; a background DiLoCo's sync programs are
        compiled too (:meth:`jaxcomm.optim.diloco.background.BackgroundSync.compile_all`).
        Returns the combinations compiled for (``[()]`` for a single program).
        ``compile_count`` counts the programs compiled.
        """
        leaves = jax.tree.leaves(batch)
        abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]
        if any(abstract) and not all(abstract):
            raise TypeError("jaxcomm: a batch is arrays or jax.ShapeDtypeStructs, not both")
        if self._place_abstract is None:
            raise TypeError(
                "jaxcomm: compile_all is for make_train_step's steps (jax.pmap's ahead-of-time "
                "compiles do not reach its calls)"
            )
        placed = self._place_abstract(batch) if any(abstract) else self._place(batch)
        if self.background is not None:
            self.background.compile_all(state)
            self._sync_programs_pending = False
        if self.phased is not None:
            return self.phased.compile_all(state, placed, steps=steps)
        self._program.lower(state, placed).compile()
        return [()]

    @property
    def compile_count(self) -> int:
        """Programs the phase-specialised step has compiled (see
        :attr:`jaxcomm.train.phased.PhasedStep.compile_count`)."""
        return self._need_phased().compile_count


def _split_batch_spec(axis_name: str, batch: PyTree) -> PyTree:
    return jax.tree.map(lambda _: P(axis_name), batch)


def init_train_state(
    mesh: Mesh, axis_name: str, tx: optax.GradientTransformation, params: PyTree
) -> TrainState:
    """The initial :class:`TrainState` of :func:`make_train_step`, placed on ``mesh``.

    ``tx.init`` runs once, jitted, with ``axis_name`` bound to the mesh's size; every leaf is
    created directly with its sharding (per-device leaves ``P(axis)``, the rest replicated).
    The caller's ``params`` are copied, never aliased (the step donates its input).
    """
    axis_name = canonical_axis(axis_name)
    n = mesh_axis_sizes(mesh, axis_name)

    def build(params):
        return initial_train_state(tx, params, axis_name, n)

    abstract = jax.eval_shape(build, params)
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        train_state_specs(abstract, axis_name),
        is_leaf=lambda x: isinstance(x, P),
    )
    return jax.jit(build, out_shardings=shardings)(params)


def make_train_step(
    mesh: Mesh,
    axis_name: str,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    params: PyTree,
    *,
    has_aux: bool = False,
    donate: bool = True,
    check_vma: bool = True,
    specialize_phases: bool = True,
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
    mean_metrics: bool = True,
    precompile: bool = True,
    check_skips_on_host: bool | None = None,
) -> tuple[TrainStep, TrainState]:
    """A jitted ``shard_map`` data-parallel train step and its initial state.

    Args:
      mesh: the device mesh; ``axis_name`` is its data-parallel axis (other axes, if any, see
        the step replicated).
      axis_name: the axis the batch is split over and ``tx`` communicates over.
      loss_fn: ``loss_fn(params, local_batch) -> loss`` (or ``(loss, aux)`` with
        ``has_aux=True``), the mean over the local batch.
      tx: an optax transformation that takes local gradients and communicates, e.g.
        ``optax.chain(jc.compressed_mean(axis_name), optax.adam(1e-3))`` or
        ``jc.onebit_adam(1e-3, axis_name=axis_name)``. Its ``init`` is called with the axis
        bound to the mesh's size.
      params: one copy of the initial parameters.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` leaves are averaged over
        devices.
      donate: donate the input state's buffers to the step (do not reuse a state after passing
        it to ``step``; copy it first, e.g. ``jax.tree.map(jnp.copy, state)``).
      check_vma: passed to ``jax.shard_map``.
      specialize_phases: compile each phase of ``tx``'s schedule as its own program and pick
        it on the host per step (a :class:`jaxcomm.train.phased.PhasedStep`): the warm-up and the
        compressed steps of ``jc.onebit_adam`` / ``jc.onebit_lamb`` / ``jc.compressed_mean``,
        0/1 Adam's four kinds of step, DiLoCo's inner and synchronising steps. Same results up
        to fp32 rounding, no ``lax.cond`` / ``lax.switch`` left in the program (whose
        pass-through copies and per-phase selects every step would pay), one compile per phase
        (see ``precompile``). A call reads the phase of its input state (a few scalar ops,
        waiting for that state) only where the schedule may have changed it (see ``steady`` in
        :func:`jaxcomm.phase`). ``False``: one program for every phase.
      precompile: with ``specialize_phases``, the first call compiles every phase combination
        the schedule can reach before it runs (``step.compile_all(state, batch)`` does it
        before the first batch), so that no later step stops to compile; so are the sync
        programs of a ``jc.diloco(background=True)`` (with or without ``specialize_phases``);
        ``False``: each when a step first needs it.
      max_in_flight: how many steps the host may dispatch ahead of the device before a call
        waits for the oldest (``None``: no bound). See :class:`jaxcomm.train.TrainStep`.
      mean_metrics: average the loss (and ``aux``) over the devices, one small all-reduce per
        step; ``False``: each device's own, stacked ``(n, ...)`` over ``axis_name``, so that a
        step that does not communicate otherwise (DiLoCo's inner steps) sends nothing at all.
      check_skips_on_host: where the jaxcomm optimizers' ``max_consecutive_skips`` is
        checked. ``True``: on the host, from each step's streaks (a small third output of
        the program), once the step is done: a run past the cap raises ``FloatingPointError``
        from a later call (at most ``max_in_flight`` calls later, at once with
        ``step.check_skips()``). ``False``: in the program (a conditional host callback,
        raising inside the step's ``JaxRuntimeError``). ``None`` (default): on the host on GPU,
        where a conditional copies its predicate to the host and blocks it every step (the
        host could no longer queue steps ahead of the device), in the program elsewhere.

    Returns:
      ``(step, state)``: ``step(state, batch) -> (state, metrics)`` (a
      :class:`jaxcomm.train.TrainStep`) where ``batch`` is the global batch: NumPy arrays or
      any ``jax.Array``s whose leading axis is split over ``axis_name`` (placed by the step;
      with several processes, each passes its own rows), and ``metrics`` the mean loss over
      devices (``(loss, aux)`` with ``has_aux``); ``state`` is the initial :class:`TrainState`
      in the global layout (:mod:`jaxcomm.train.layout`), placed on ``mesh``.
      ``step.lower(state, batch).compile().as_text()`` gives the HLO of the program that state
      runs. Works on Explicit-axis meshes (``jax.make_mesh``'s default) and Auto ones.
    """
    axis_name = canonical_axis(axis_name)
    state = init_train_state(mesh, axis_name, tx, params)
    on_host = _on_gpu(mesh.devices.flat) if check_skips_on_host is None else check_skips_on_host
    skip_names: list[str] | None = [] if on_host else None

    def global_step(state: TrainState, batch, probe: bool = False):
        specs = train_state_specs(state, axis_name)
        host = _caps_on_host(on_host)

        def body(state, batch):
            blocks = state.params if params_are_per_device(state.opt_state) else None
            if probe:  # the phases only: the step itself is dead code
                with record_phases() as recorded:
                    local_train_step(
                        loss_fn, tx, axis_name, has_aux, local_view(state), batch, True, blocks
                    )
                return ensure_varying(recorded.as_array(), axis_name)[None]
            args = (loss_fn, tx, axis_name, has_aux, local_view(state), batch, True, blocks)
            with _skip_caps(host, state) as caps:
                new, metrics = local_train_step(*args, mean_metrics)
            if blocks is not None:
                new = TrainState(new.params, global_view(new.opt_state))
            out = (global_view(new) if blocks is None else new), metrics
            if caps is None:
                return out
            skip_names[:] = caps.names
            return *out, caps.report(axis_name)

        metrics_spec = P() if mean_metrics else P(axis_name)
        step_specs = (specs, metrics_spec) + ((P(axis_name),) if host else ())
        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, _split_batch_spec(axis_name, batch)),
            out_specs=P(axis_name) if probe else step_specs,
            check_vma=check_vma,
        )
        try:
            return mapped(state, batch)
        except ValueError as err:
            if "could not infer replication" not in str(err):
                raise
            raise ValueError(
                f"jaxcomm: make_train_step's optimizer returned parameters that differ across "
                f"{axis_name!r} (it does not average the gradients): chain "
                f"jc.compressed_mean({axis_name!r}, jc.NoCompression()) in front of it, or use a "
                "jaxcomm optimizer such as jc.onebit_adam"
            ) from None

    donate_argnums = (0,) if donate else ()
    if specialize_phases:
        probe = functools.partial(global_step, probe=True)
        program = PhasedStep(
            global_step, probe, donate_argnums=donate_argnums, precompile=precompile
        )
    else:
        program = jax.jit(global_step, donate_argnums=donate_argnums)
    place = functools.partial(place_batch, mesh=mesh, axis_name=axis_name)
    update = background_update(tx)
    background = None if update is None else BackgroundSync(update, mesh, axis_name)
    rows = NamedSharding(mesh, P(axis_name))

    def place_abstract(batch):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), batch)

    step = TrainStep(
        program,
        place,
        max_in_flight=max_in_flight,
        background=background,
        place_abstract=place_abstract,
        precompile=precompile,
        skip_names=skip_names,
    )
    return step, state


def _on_gpu(devices) -> bool:
    """Whether the step runs on NVIDIA or AMD GPUs (attached or described, for an
    ahead-of-time compile)."""
    return any(getattr(d, "platform", "") in GPU_PLATFORMS for d in devices)


_caller = threading.local()


@contextlib.contextmanager
def _caps_in_program():
    """Within: a step traced by its caller keeps its skip caps in the program."""
    previous = getattr(_caller, "tracing", False)
    _caller.tracing = True
    try:
        yield
    finally:
        _caller.tracing = previous


def _caps_on_host(on_host: bool) -> bool:
    """Whether the step being traced checks its skip caps on the host."""
    return on_host and not getattr(_caller, "tracing", False)


def _skip_caps(on_host: bool, like: PyTree):
    """:func:`jaxcomm.guard.skip_caps_on_host` at ``like``'s trace level, or no collector."""
    if not on_host:
        return contextlib.nullcontext()
    return skip_caps_on_host(jax.tree.leaves(like)[0])


def _owned(tree: PyTree) -> PyTree:
    """Fresh copies, so that donating the train state never deletes the caller's arrays
    (``device_put`` may alias its input even with ``may_alias=False``)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def make_pmap_train_step(
    axis_name: str,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    params: PyTree,
    *,
    devices: Sequence[jax.Device] | None = None,
    has_aux: bool = False,
    donate: bool = True,
    specialize_phases: bool = True,
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
    check_skips_on_host: bool | None = None,
) -> tuple[Callable, TrainState]:
    """The ``jax.pmap`` variant of :func:`make_train_step`.

    The state is in the pmap layout (every leaf stacked ``(n, ...)``; :func:`from_pmap_layout`
    turns it into the global layout, e.g. to compare or checkpoint interchangeably).
    ``step(state, batch)`` takes the same global batch as the ``shard_map`` step (split into
    ``n`` equal parts on its leading axis) and returns ``(state, metrics)``, metrics unstacked.
    ``step.pmapped`` is the underlying ``pmap`` function (batch already ``(n, b, ...)``);
    with ``specialize_phases`` (as :func:`make_train_step`'s: one ``pmap`` per phase, chosen on
    the host) it is the :class:`jaxcomm.train.phased.PhasedStep`, and ``step.phased`` too.
    Each program compiles when a step first needs it (``jax.pmap``'s ahead-of-time compiles
    do not reach its calls: :func:`make_train_step` compiles them all on its first call).

    ``tx`` must average the gradients over ``axis_name`` (a jaxcomm optimizer, or an optax one
    chained after :func:`jaxcomm.compressed_mean`). :func:`make_train_step` refuses one that
    does not; ``pmap`` tracks no replication, so here each device's parameters would drift
    apart silently. ``check_skips_on_host`` as :func:`make_train_step`'s.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    opt_state = jax.jit(init_opt_state, static_argnums=(0, 2, 3))(tx, params, axis_name, n)
    stacked_params = jax.tree.map(lambda p: repeat(p, n), params)
    state = _owned(TrainState(stacked_params, opt_state))  # pmap places rows on first call

    on_host = _on_gpu(devices) if check_skips_on_host is None else check_skips_on_host
    skip_names: list[str] | None = [] if on_host else None

    def step_body(state, batch):
        return local_train_step(loss_fn, tx, axis_name, has_aux, state, batch, varying=False)

    def body(state, batch):
        with _skip_caps(on_host, state) as caps:
            out = step_body(state, batch)
        if caps is None:
            return out
        skip_names[:] = caps.names
        return *out, caps.report(None)[0]

    def probe(state, batch):  # the phases only: the step itself is dead code
        with record_phases() as recorded:
            step_body(state, batch)
        return recorded.as_array()

    step_axes = (0, None, 0) if on_host else (0, None)

    def compile_pmap(fn, donate_argnums=(), out_axes=step_axes):
        return jax.pmap(
            fn,
            axis_name=axis_name,
            devices=devices,
            out_axes=out_axes,
            donate_argnums=donate_argnums,
        )

    donate_argnums = (0,) if donate else ()
    if specialize_phases:
        pmapped = PhasedStep(
            body,
            probe,
            donate_argnums=donate_argnums,
            compile=compile_pmap,
            compile_probe=functools.partial(compile_pmap, out_axes=0),
            precompile=False,
        )
    else:
        pmapped = compile_pmap(body, donate_argnums)

    def split(batch):
        def rows(path, x):
            shape = jnp.shape(x)
            if not shape or shape[0] % n:
                raise ValueError(
                    f"jaxcomm: batch leaf {jax.tree_util.keystr(path) or 'the batch'} has shape "
                    f"{tuple(shape)}: its leading dimension must split evenly over {n} devices "
                    f"(pass a multiple of {n} rows)"
                )
            return jnp.reshape(x, (n, -1, *shape[1:]))

        return jax.tree_util.tree_map_with_path(rows, batch)

    step = TrainStep(pmapped, split, max_in_flight=max_in_flight, skip_names=skip_names)
    step.pmapped = pmapped
    return step, state
