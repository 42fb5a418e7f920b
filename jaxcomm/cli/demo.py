"""``jaxcomm demo``: train one language model data-parallel with each optimizer and compare.

A byte-level transformer LM (:mod:`jaxcomm.cli.models`: token + position embeddings, 2
pre-LayerNorm blocks with a fused ``qkv`` bias, 4 heads, 0.135M parameters; the full 256-byte
vocabulary, unfiltered, so rare bytes' embedding rows and the key part of the ``qkv`` bias get
(near) zero gradient) is trained on the source of ten Python standard-library modules (no
download, held-out split) on every device of a mesh (8 simulated CPU devices by default) with:

* ``adam``: exact ``pmean`` of the gradients, then Adam (the baseline);
* ``compressed_mean``: ``jc.compressed_mean`` (1-bit with error feedback, exact warm-up), then Adam;
* ``onebit_adam``: 1-bit Adam (exact warm-up, then 1-bit momentum);
* ``zero_one_adam``: 0/1 Adam (variance updates at doubling intervals, then local steps; its
  schedule follows the run length, ``total_steps``);
* ``onebit_lamb``: 1-bit LAMB (exact warm-up, then 1-bit momentum with frozen trust ratios);
* ``diloco_int4``: ``jc.diloco`` (inner Adam, outer Nesterov SGD 0.7/0.9) with one int4 (error
  feedback) all-reduce of the outer gradients every ``diloco_sync_every`` (50) steps, evaluated
  on its outer parameters;
* ``sharded_int8`` (not in the default list): ``jc.sharded`` Adam (ZeRO 1-2: each device keeps
  the Adam state of its 1/n of the parameters) with int8 gradients (qgZ) and int8 weights (qwZ).

Bytes on the wire. Each optimizer's step is one of these kinds: an *exact* step (fp32 mean of
a parameter-shaped tree), a *1-bit* step (``OneBit`` mean of such a tree), a *local* step
(no communication), an *int4 sync* (DiLoCo's ``Quantize(bits=4, error_feedback=True)`` mean of
the parameter-shaped outer gradient) or ``sharded_int8``'s step (an int8 reduce-scatter of the
gradients and an int8 all-gather of the parameters). The bytes per device of each kind are read
from the compiled HLO of its collectives on this mesh (:mod:`jaxcomm.inspect`); each optimizer's
kind of every step is read from its state's counters, so the totals follow what the run did.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

EXACT, ONEBIT, LOCAL = "exact", "1-bit", "local"
SHARDED_INT8 = "int8 scatter+gather"
DILOCO_INT4 = "int4 sync"
RATES_GBIT = (1, 10, 100)


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and schedules of the demo (defaults: about half a minute per optimizer on 2 cores;
    issue 13's task: 768 steps of 8 devices x 8 windows of 32 bytes, ``bucket_bytes=None``)."""

    steps: int = 768
    devices: int = 8
    batch_per_device: int = 8
    context: int = 32
    #: the transformer (:class:`jaxcomm.cli.models.ByteTransformer`)
    width: int = 64
    heads: int = 4
    layers: int = 2
    learning_rate: float = 1e-3
    #: LAMB scales each layer's step by its trust ratio ||p|| / ||update||, so its learning rate
    #: is on another scale (1e-2 here reaches Adam's loss; 1e-3 is far slower).
    lamb_learning_rate: float = 1e-2
    warmup_fraction: float = 0.15
    #: None: one bucket (one 1-bit scale) for the whole model; 1: one per parameter (DeepSpeed).
    bucket_bytes: int | None = None
    #: 0/1 Adam: variance updates per doubling of their interval; frozen-stage steps per doubling
    #: of the sync interval; the largest sync interval (None: the optimizer's defaults;
    #: ``local_step_scaler`` then follows the run length, ``total_steps``).
    var_update_scaler: int | None = None
    local_step_scaler: int | None = None
    local_step_clipper: int | None = None
    #: DiLoCo: steps between two syncs of the outer parameters (H)
    diloco_sync_every: int = 50
    eval_every: int = 50
    #: held-out windows (each predicts ``context`` bytes)
    held_out: int = 512
    seed: int = 0
    methods: tuple[str, ...] = (
        "adam",
        "compressed_mean",
        "onebit_adam",
        "zero_one_adam",
        "onebit_lamb",
        "diloco_int4",
    )

    @property
    def warmup_steps(self) -> int:
        return max(1, int(round(self.warmup_fraction * self.steps)))


@dataclass
class RunResult:
    """One optimizer's run."""

    method: str
    losses: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    #: communication after the last step (0/1 Adam: the final parameter average)
    final_kinds: list[str] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    final_eval_loss: float = math.nan
    final_accuracy: float = math.nan
    seconds: float = 0.0


def make_model(cfg: DemoConfig):
    """The byte-level transformer LM of ``cfg`` (parameters: ``make_model(cfg).init(cfg.seed)``)."""
    from jaxcomm.cli.models import ByteTransformer

    return ByteTransformer(
        context=cfg.context, width=cfg.width, heads=cfg.heads, layers=cfg.layers
    )


#: Every method ``--methods`` accepts (add a new one here and in :func:`_optimizer`).
METHODS = (
    "adam",
    "compressed_mean",
    "onebit_adam",
    "zero_one_adam",
    "onebit_lamb",
    "diloco_int4",
    "sharded_int8",
)


def check_methods(methods) -> tuple[str, ...]:
    """``methods`` as a tuple, or a ``ValueError`` naming the unknown ones and the valid ones."""
    methods = tuple(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid methods: {', '.join(METHODS)}"
        )
    if not methods:
        raise ValueError(f"no method given; valid methods: {', '.join(METHODS)}")
    return methods


def _optimizer(method: str, cfg: DemoConfig, axis: str):
    """``(transformation, kind_of_step(opt_state) -> EXACT | ONEBIT | LOCAL)`` for a method."""
    import optax

    import jaxcomm as jc

    lr, warm, bb = cfg.learning_rate, cfg.warmup_steps, cfg.bucket_bytes
    if method == "adam":
        tx = optax.chain(
            jc.compressed_mean(axis, compressor=jc.NoCompression(), bucket_bytes=bb),
            optax.adam(lr),
        )
        return tx, lambda s: EXACT
    if method == "compressed_mean":
        tx = optax.chain(
            jc.compressed_mean(axis, bucket_bytes=bb, warmup_steps=warm), optax.adam(lr)
        )
        return tx, lambda s: EXACT if int(s[0].count) < warm else ONEBIT
    if method == "onebit_adam":
        tx = jc.onebit_adam(lr, freeze_step=warm, axis_name=axis, bucket_bytes=bb)
        return tx, lambda s: EXACT if int(s.count) < warm else ONEBIT
    if method == "zero_one_adam":
        # jaxcomm's schedule for a run of cfg.steps (the variance freezes with the warm-up).
        scalers = dict(
            var_update_scaler=cfg.var_update_scaler,
            local_step_scaler=cfg.local_step_scaler,
            local_step_clipper=cfg.local_step_clipper,
        )
        tx = jc.zero_one_adam(
            lr,
            var_freeze_step=warm,
            total_steps=cfg.steps,
            axis_name=axis,
            bucket_bytes=bb,
            **{k: v for k, v in scalers.items() if v is not None},
        )

        def kind(s) -> str:
            t = int(s.count) + 1
            if t <= warm:
                return EXACT if t % int(s.var_interval) == 0 else ONEBIT
            return ONEBIT if t % int(s.local_interval) == 0 else LOCAL

        return tx, kind
    if method == "onebit_lamb":
        tx = jc.onebit_lamb(
            cfg.lamb_learning_rate, freeze_step=warm, axis_name=axis, bucket_bytes=bb
        )
        return tx, lambda s: EXACT if int(s.count) < warm else ONEBIT
    if method == "diloco_int4":
        H = cfg.diloco_sync_every
        tx = jc.diloco(
            optax.adam(lr),
            optax.sgd(0.7, momentum=0.9, nesterov=True),
            H,
            axis,
            compressor=jc.Quantize(bits=4, error_feedback=True),
            bucket_bytes=bb,
        )
        return tx, lambda s: DILOCO_INT4 if (int(s.count) + 1) % H == 0 else LOCAL
    if method == "sharded_int8":
        return _sharded_int8(optax.adam(lr), axis, bb), lambda s: SHARDED_INT8
    check_methods([method])  # an unknown name: a ValueError listing the valid ones
    raise ValueError(f"jaxcomm demo: METHODS lists {method!r} but _optimizer has no branch for it")


def _sharded_int8(inner, axis: str, bucket_bytes: int | None):
    import jaxcomm as jc

    int8 = jc.Quantize(bits=8)
    return jc.sharded(
        inner, axis, compressor=int8, gather_compressor=int8, bucket_bytes=bucket_bytes
    )


def _sharded_int8_bytes(mesh, axis: str, params, bucket_bytes: int | None) -> float:
    """Bytes per device of one ``sharded_int8`` update of a parameter-shaped tree (HLO)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from jaxcomm.inspect import wire_bytes

    tx = _sharded_int8(optax.identity(), axis, bucket_bytes)
    tree = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
    n = mesh.shape[axis]
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct((n, *p.shape), p.dtype), tree)

    def body(g, p):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(p), p)[0]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=P()))
    return wire_bytes(fn.lower(grads, tree).compile().as_text())


def wire_bytes_per_kind(
    mesh, axis: str, params, bucket_bytes: int | None, methods: tuple[str, ...] = METHODS
) -> dict[str, float]:
    """Bytes per device of an exact and a 1-bit mean of a parameter-shaped tree, and (if
    ``methods`` use them) of an int4 (error feedback) mean and of a ``sharded_int8`` step
    (HLO)."""
    import jaxcomm as jc
    from jaxcomm.inspect import mean_wire_bytes

    out = {LOCAL: 0.0}
    kinds = [(EXACT, jc.NoCompression()), (ONEBIT, jc.OneBit())]
    if "diloco_int4" in methods:  # DiLoCo's outer gradients
        kinds.append((DILOCO_INT4, jc.Quantize(bits=4, error_feedback=True)))
    for kind, comp in kinds:
        out[kind] = mean_wire_bytes(mesh, axis, params, comp, bucket_bytes)
    if "sharded_int8" in methods:
        out[SHARDED_INT8] = _sharded_int8_bytes(mesh, axis, params, bucket_bytes)
    return out


def train(method: str, cfg: DemoConfig, mesh, data, progress: Callable[[int], None] | None = None):
    """Train one model with ``method`` on ``data`` (a :class:`~jaxcomm.cli.models.ByteBatches`);
    returns a :class:`RunResult`."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm.train.step import make_train_step

    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    model = make_model(cfg)
    # Host (NumPy) parameters: under jax.distributed the step's state must be built from
    # process-agnostic data.
    params = model.init(cfg.seed)
    tx, kind_of = _optimizer(method, cfg, axis)
    step, state = make_train_step(mesh, axis, model.loss, tx, params)
    batch_sharding = NamedSharding(mesh, P(axis))

    def global_batch(arrays):
        # Every process draws the same global batch (same seed) and contributes its devices'
        # rows: the same code runs on one process with 8 devices or on 8 processes with one.
        return tuple(
            jax.make_array_from_callback(a.shape, batch_sharding, lambda index, a=a: a[index])
            for a in arrays
        )

    held_inputs, held_targets = data.held_out(cfg.held_out)

    @jax.jit
    def evaluate(params):
        logits = model.apply(params, held_inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, held_targets).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == held_targets)

    rng = np.random.default_rng(cfg.seed + 1)  # the same batches for every method
    result = RunResult(method)
    start = time.perf_counter()
    for i in range(cfg.steps):
        batch = global_batch(data.sample(rng, (n * cfg.batch_per_device,)))
        result.kinds.append(kind_of(state.opt_state))
        state, loss = step(state, batch)
        result.losses.append(float(loss))
        if (i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps:
            eval_loss, accuracy = evaluate(evaluated_params(state))
            result.eval_steps.append(i + 1)
            result.eval_losses.append(float(eval_loss))
        if progress is not None:
            progress(1)
    result.seconds = time.perf_counter() - start
    if _averaged(state.opt_state):
        result.final_kinds.append(EXACT)
    result.final_eval_loss = result.eval_losses[-1]
    result.final_accuracy = float(accuracy)
    return result


def _averaged(opt_state) -> bool:
    import jaxcomm as jc

    diloco = isinstance(opt_state, jc.DiLoCoState)
    return jc.train.layout.params_are_per_device(opt_state) and not diloco


def evaluated_params(state):
    """The model a run is evaluated on, from its ``jc.TrainState``.

    DiLoCo: its outer parameters (``jc.diloco_params``, replicated: no communication; the
    local copies drift between syncs). Per-device parameters otherwise (0/1 Adam, whose devices
    drift apart between synchronisations): their average, one exact all-reduce that the demo
    counts in the traffic. Else the (replicated) parameters.
    """
    import jax
    import jax.numpy as jnp

    import jaxcomm as jc

    if isinstance(state.opt_state, jc.DiLoCoState):
        theta = jc.diloco_params(state.opt_state)
        return jax.tree.map(lambda p, t: t.astype(p.dtype), state.params, theta)
    if _averaged(state.opt_state):
        return jax.tree.map(lambda p: jnp.mean(p, axis=0), state.params)
    return state.params


def summarize(
    results: list[RunResult], bytes_per_kind: dict[str, float], warmup_steps: int | None = None
) -> list[dict[str, Any]]:
    """Rows of the final table: losses, accuracy, traffic and its ratio to the baseline.

    A run that diverged gets ``diverged`` (step, what, likely cause) and no ratios
    (:func:`jaxcomm.cli.demo_report.annotate`); ``warmup_steps`` dates the cause.
    """
    from jaxcomm.cli import demo_report

    rows = []
    for r in results:
        total = sum(bytes_per_kind[k] for k in r.kinds + r.final_kinds)
        row = dict(
            method=r.method,
            eval_loss=r.final_eval_loss,
            train_loss=float(np.mean(r.losses[-max(1, len(r.losses) // 10) :])),
            accuracy=r.final_accuracy,
            bytes_per_step=total / len(r.kinds),  # the final average is spread over the run
            total_bytes=total,
            steps={k: r.kinds.count(k) for k in (EXACT, ONEBIT, LOCAL, DILOCO_INT4, SHARDED_INT8)},
            seconds=r.seconds,
        )
        for rate in RATES_GBIT:
            row[f"comm_s_{rate}gbit"] = total * 8 / (rate * 1e9)
        rows.append(row)
    demo_report.annotate(rows, results, warmup_steps)
    return rows


def plot(
    results: list[RunResult],
    bytes_per_kind: dict[str, float],
    path: str,
    warmup_steps: int | None = None,
) -> list[str]:
    """Held-out loss against step and against cumulative bytes (PNG); returns notes on the runs
    that diverged (cut at the step they diverged, see :func:`jaxcomm.cli.demo_report.plot`)."""
    from jaxcomm.cli import demo_report

    return demo_report.plot(results, bytes_per_kind, path, warmup_steps=warmup_steps)[0]


def run(
    cfg: DemoConfig, *, plot_path: str | None, json_path: str | None, out_dir: str | None = None
) -> list[dict[str, Any]]:
    """Train every method, print the report, write the plot/JSON; returns the table rows.

    ``json_path="-"`` prints the JSON document on stdout and the human report on stderr.
    ``out_dir`` (created if missing) also receives ``demo.json``. The progress bar goes to
    stderr.
    """
    import jax
    from jax.sharding import AxisType
    from rich.console import Console
    from rich.progress import Progress

    from jaxcomm.cli import demo_report
    from jaxcomm.cli.models import ByteBatches

    if jax.process_count() > 1:
        n = len(jax.devices())  # every process's devices
        mesh = jax.make_mesh((n,), ("dp",), axis_types=(AxisType.Auto,))
    else:
        n = min(cfg.devices, len(jax.devices()))
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("dp",), axis_types=(AxisType.Auto,))
    lead = jax.process_index() == 0
    data = ByteBatches.from_corpus(context=cfg.context)
    results = []
    with Progress(disable=not lead, console=Console(stderr=True)) as bar:
        for method in cfg.methods:
            task = bar.add_task(f"{method:>16}", total=cfg.steps)
            results.append(train(method, cfg, mesh, data, lambda k, t=task: bar.advance(t, k)))
    params = make_model(cfg).init(cfg.seed)
    bytes_per_kind = wire_bytes_per_kind(mesh, "dp", params, cfg.bucket_bytes, cfg.methods)
    rows = summarize(results, bytes_per_kind, cfg.warmup_steps)
    if not lead:
        return rows
    human = sys.stderr if json_path == "-" else sys.stdout
    report = demo_report.format_report(
        rows, bytes_per_kind, devices=n, steps=cfg.steps, warmup_steps=cfg.warmup_steps
    )
    print(report, file=human, flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    if plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        notes = plot(results, bytes_per_kind, plot_path, cfg.warmup_steps)
        print(f"plot: {plot_path}" + (f" ({'; '.join(notes)})" if notes else ""), file=human)
    doc = demo_report.json_safe(
        dict(
            config=asdict(cfg),
            devices=n,
            bytes_per_kind=bytes_per_kind,
            rows=rows,
            runs=[asdict(r) for r in results],
        )
    )
    paths = [os.path.join(out_dir, "demo.json")] if out_dir else []
    if json_path and json_path != "-" and os.path.abspath(json_path) not in map(
        os.path.abspath, paths
    ):  # --json DIR/demo.json: written once
        paths.append(json_path)
    for path in paths:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        print(f"json: {path}", file=human)
    if json_path == "-":
        json.dump(doc, sys.stdout, indent=1, allow_nan=False)
        print(flush=True)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``jaxcomm demo`` options (every default is in its help text)."""
    d = DemoConfig()
    parser.add_argument(
        "--steps", type=int, default=d.steps, help=f"training steps per method ({d.steps})"
    )
    parser.add_argument(
        "--devices", type=int, default=d.devices,
        help=f"simulated CPU devices in one process ({d.devices})",
    )
    parser.add_argument(
        "--batch", type=int, default=d.batch_per_device,
        help=f"windows per device per step ({d.batch_per_device})",
    )
    parser.add_argument(
        "--lr", type=float, default=d.learning_rate,
        help=f"learning rate of the Adam variants ({d.learning_rate:g})",
    )
    parser.add_argument(
        "--lamb-lr", type=float, default=d.lamb_learning_rate,
        help=f"learning rate of onebit_lamb ({d.lamb_learning_rate:g})",
    )
    parser.add_argument(
        "--warmup-fraction", type=float, default=d.warmup_fraction,
        help=f"share of the steps with exact communication before compression "
        f"({d.warmup_fraction:g})",
    )
    parser.add_argument(
        "--methods", default=",".join(d.methods), metavar="M1,M2,...",
        help=f"comma-separated optimizers to compare, from: {', '.join(METHODS)} "
        f"(default: {', '.join(d.methods)})",
    )
    parser.add_argument(
        "--out", default="runs", metavar="DIR",
        help="directory for demo.png and demo.json (runs; created if missing)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="PNG",
        help="plot path (default: DIR/demo.png; '' for no plot)",
    )
    parser.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="PATH",
        help="--json alone: print the results as JSON on stdout (the table goes to stderr); "
        "--json PATH: also write them to PATH",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help=f"random seed ({d.seed})")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="call jc.init_distributed() first (one process per rank, e.g. under "
        "'jaxcomm launch -n 2 -m jaxcomm demo --distributed', torchrun or SLURM); the mesh "
        "spans every process's devices",
    )


def missing_extra(plot: bool) -> str | None:
    """What to install when the plot needs matplotlib (the ``examples`` extra) and it is
    missing, else None. The demo itself needs only the core dependencies (its model is plain
    JAX)."""
    import importlib.util

    if not plot:
        return None
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules, a broken install
        found = False
    if found:
        return None
    return (
        "jaxcomm demo needs matplotlib for its plot (the 'examples' extra): "
        "pip install 'jaxcomm[examples]' (or pass --plot '' to skip the plot)"
    )


def main_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``jaxcomm demo`` (see :func:`add_arguments`)."""
    try:  # every name checked before anything trains
        methods = check_methods(m.strip() for m in args.methods.split(",") if m.strip())
    except ValueError as e:
        print(f"jaxcomm demo: {e}", file=sys.stderr)
        return 2
    plot_path = os.path.join(args.out, "demo.png") if args.plot is None else args.plot
    from jaxcomm.cli._paths import output_problem

    for flag, path, is_dir in (("--out", args.out, True), ("--json", args.json, False),
                               ("--plot", plot_path, False)):  # fmt: skip
        problem = output_problem(path, directory=is_dir)
        if problem:  # before training, not after minutes of it
            print(f"jaxcomm demo: {flag}: {problem}", file=sys.stderr)
            return 2
    for flag, value, ok, want in (
        ("--steps", args.steps, args.steps >= 1, ">= 1"),
        ("--devices", args.devices, args.devices >= 1, ">= 1"),
        ("--batch", args.batch, args.batch >= 1, ">= 1"),
        ("--lr", args.lr, args.lr > 0, "> 0"),
        ("--lamb-lr", args.lamb_lr, args.lamb_lr > 0, "> 0"),
        ("--warmup-fraction", args.warmup_fraction, 0 <= args.warmup_fraction <= 1, "in [0, 1]"),
    ):
        if not ok:  # else a traceback from deep inside JAX, or an empty report
            print(f"jaxcomm demo: {flag} must be {want}, got {value}", file=sys.stderr)
            return 2
    problem = missing_extra(bool(plot_path))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import jax

    if args.distributed:
        from jaxcomm.runtime import init_distributed

        init_distributed()
    elif "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", args.devices)
    cfg = DemoConfig(
        steps=args.steps,
        devices=args.devices,
        batch_per_device=args.batch,
        learning_rate=args.lr,
        lamb_learning_rate=args.lamb_lr,
        warmup_fraction=args.warmup_fraction,
        methods=methods,
        seed=args.seed,
        eval_every=max(1, min(50, args.steps // 4)),
    )
    run(cfg, plot_path=plot_path or None, json_path=args.json, out_dir=args.out or None)
    return 0


if __name__ == "__main__":
    from jaxcomm.cli._text import terminal_text

    parser = argparse.ArgumentParser(prog="jaxcomm demo", description=terminal_text(__doc__))
    add_arguments(parser)
    sys.exit(main_from_args(parser.parse_args()))
