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

Bytes on the wire: each step's kind (:mod:`jaxcomm.cli.demo_methods`) is read from the
optimizer's state, so the totals follow what the run did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np

from jaxcomm.cli.demo_methods import (
    EXACT,
    METHODS,
    DemoConfig,
    RunResult,
    check_methods,
    make_model,
    optimizer_for,
    wire_bytes_per_kind,
)


def train(
    method: str, cfg: DemoConfig, mesh, data, progress: Callable[[int, float], None] | None = None
):
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
    tx, kind_of = optimizer_for(method, cfg, axis)
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
            progress(1, result.losses[-1])
    result.seconds = time.perf_counter() - start
    if _averaged(state.opt_state):
        result.final_kinds.append(EXACT)
    result.final_eval_loss = result.eval_losses[-1]
    result.final_accuracy = float(accuracy)
    return result


def _bar(disable: bool):
    from rich.console import Console
    from rich.progress import Progress

    return Progress(disable=disable, console=Console(stderr=True))


def _advance(bar, task, k: int, loss: float) -> None:
    bar.advance(task, k)


def _averaged(opt_state) -> bool:
    import jaxcomm as jc
    from jaxcomm.train.layout import params_are_per_device

    diloco = isinstance(opt_state, jc.DiLoCoState)
    return params_are_per_device(opt_state) and not diloco


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


def run(
    cfg: DemoConfig, *, plot_path: str | None, json_path: str | None, out_dir: str | None = None
) -> list[dict[str, Any]]:
    """Train every method, print the report, write the plot/JSON; returns the table rows.

    ``json_path="-"`` prints the JSON document on stdout and the human report on stderr.
    ``out_dir`` (created if missing) also receives ``demo.json``. The progress bar goes to
    stderr on a terminal; otherwise plain progress lines go where the report goes.
    """
    import importlib.util
    from contextlib import nullcontext

    import jax
    from jax.sharding import AxisType

    from jaxcomm.cli import demo_report
    from jaxcomm.cli.models import ByteBatches
    from jaxcomm.cli.progress import StepLog, is_terminal

    if jax.process_count() > 1:
        n = len(jax.devices())  # every process's devices
        mesh = jax.make_mesh((n,), ("dp",), axis_types=(AxisType.Auto,))
    else:
        n = min(cfg.devices, len(jax.devices()))
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("dp",), axis_types=(AxisType.Auto,))
    lead = jax.process_index() == 0
    data = ByteBatches.from_corpus(context=cfg.context)
    results = []
    human = sys.stderr if json_path == "-" else sys.stdout
    # rich's bar draws only on a terminal: elsewhere (CI logs, nohup, | tee) plain lines.
    has_rich = importlib.util.find_spec("rich") is not None  # the 'cli' extra
    plain = lead and not (has_rich and is_terminal(human) and is_terminal(sys.stderr))
    with _bar(disable=not lead or plain) if has_rich else nullcontext() as bar:
        for method in cfg.methods:
            progress = None
            if plain:
                progress = StepLog(f"demo {method}", cfg.steps, stream=human).step
            elif bar is not None:
                progress = partial(_advance, bar, bar.add_task(f"{method:>16}", total=cfg.steps))
            results.append(train(method, cfg, mesh, data, progress))
    params = make_model(cfg).init(cfg.seed)
    bytes_per_kind = wire_bytes_per_kind(mesh, "dp", params, cfg.bucket_bytes, cfg.methods)
    rows = demo_report.summarize(results, bytes_per_kind, cfg.warmup_steps)
    if not lead:
        return rows
    report = demo_report.format_report(
        rows, bytes_per_kind, devices=n, steps=cfg.steps, warmup_steps=cfg.warmup_steps
    )
    print(report, file=human, flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    if plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        drawn = demo_report.plot(results, bytes_per_kind, plot_path, warmup_steps=cfg.warmup_steps)
        notes = drawn[0]
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


def _number(parser: argparse.ArgumentParser, flag: str, default: int | float, what: str) -> None:
    """An int or float option whose help ends with its default."""
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    parser.add_argument(flag, type=type(default), default=default, help=f"{what} ({shown})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``jaxcomm demo`` options (every default is in its help text)."""
    d = DemoConfig()
    for flag, default, what in (
        ("--steps", d.steps, "training steps per method"),
        ("--devices", d.devices, "simulated CPU devices in one process"),
        ("--batch", d.batch_per_device, "windows per device per step"),
        ("--lr", d.learning_rate, "learning rate of the Adam variants"),
        ("--lamb-lr", d.lamb_learning_rate, "learning rate of onebit_lamb"),
        ("--warmup-fraction", d.warmup_fraction,
         "share of the steps with exact communication before compression"),
    ):
        _number(parser, flag, default, what)
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
    _number(parser, "--seed", d.seed, "random seed")
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
        "jaxcomm demo needs matplotlib for its plot (the 'cli' extra): "
        "pip install 'jaxcomm[cli]' (or pass --plot '' to skip the plot)"
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
