"""The user's path at 1 Gbit/s: the README's code with default arguments, timed as users run it.

Two processes (one CPU device each, gloo), each in its own network namespace, joined by a
full-duplex link shaped with ``tc tbf`` to ``--rate`` each way (``duplex.sh``, through the shared
driver ``benchmarks/_two_ranks.py``; ``--topo lo``: one shaped loopback, one queue for both
directions, the half-duplex setup of the earlier results). Each process starts the way a user's
script does: ``import jaxcomm`` and ``jax.distributed.initialize(coordinator, num_processes,
process_id)`` called directly (from duplex.sh's ``COORD``, ``NPROC``, ``RANK``); JAX's default mesh
(``jax.make_mesh``, Explicit axes); only public API, every jaxcomm argument at its default. Rows:

* ``readme_pmean`` / ``readme_onebit``: the README's Use block (``compressed_pmean`` with
  ``jc.OneBit()`` in ``shard_map``, returning ``(mean, state)``, state donated) on 64 MiB of
  fp32 gradients per process, and the same block with ``lax.pmean`` in place of the call;
* ``local``: the floor, ``optax.adam`` on the process's own batch with no communication;
* ``exact_adam``: ``jc.make_train_step`` with ``optax.chain(jc.compressed_mean("dp",
  jc.NoCompression()), optax.adam(lr))``;
* ``onebit_adam``: ``jc.make_train_step`` with ``jc.onebit_adam(lr, freeze_step=4,
  axis_name="dp")``, timed after the freeze;
* ``zero_one_adam``: ``jc.make_train_step`` with ``jc.zero_one_adam(lr, axis_name="dp",
  total_steps=40)`` (its documented call), timed after the variance freeze, so every round holds
  whole cycles (one local step and one synchronisation with the default cap of 2);
* on request, beside them: ``onebit_adam_single`` (``specialize_phases=False``: one program
  with the schedule's branches), ``*_unbounded`` (``max_in_flight=None``: what the bound on
  queued steps costs) and ``onebit_adam_program`` (tuned: the compressed phase's
  program called directly, no phase read per step, the batch placed once).

Model: the MLP of ``train_step_1gbit.py`` (4 x 2048 x 2048, 16.8M fp32 parameters, 64 MiB),
16 examples per process. Timing as a training loop runs: each round runs ``--steps`` steps of
one method without reading a value, then waits for the last; rounds alternate the methods;
the table gives each method's median step over ``--repeats`` rounds, slower rank, and the
ratios asked of jaxcomm. The JSON (``--json``) records the command, versions, machine, date and
the link (``"link"``: duplex.sh's topology, the rate, full duplex or not).

Usage (root, for duplex.sh's namespaces and ``tc``)::

    python benchmarks/user_path.py [--rate 1gbit] [--topo auto|lo] [--repeats 5] [--steps 4]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("readme_pmean", "readme_onebit", "local", "exact_adam", "onebit_adam", "zero_one_adam")
#: Beside the default rows, on request (``--methods``): a setting, and a tuned call.
EXTRA = (
    "onebit_adam_single",
    "onebit_adam_program",
    "exact_adam_unbounded",
    "onebit_adam_unbounded",
)
LR = 1e-3
WIDTH, LAYERS, BATCH = 2048, 4, 16


def _parse(argv=None) -> argparse.Namespace:
    from _two_ranks import two_rank_parser

    p = two_rank_parser(__doc__.split("\n")[0], methods=METHODS, timeout=1800.0)
    p.add_argument("--steps", type=int, default=4, help="steps per round, unread (4)")
    return p.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from _two_ranks import barrier as make_barrier
    from _two_ranks import finish_worker, mlp, start_as_user
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    rank, n, mesh = start_as_user()
    split = NamedSharding(mesh, P("dp"))
    params, loss_fn, batch = mlp(WIDTH, LAYERS, BATCH, rank, linear_last=True)

    def readme_block(reduce):
        """The README's Use block at 64 MiB per process, ``reduce`` in place of the call."""
        compressor = jc.OneBit()
        grads_like = {"w": jnp.zeros((4096, 4096))}
        state = jc.stack_per_device(jc.init_state(compressor, grads_like, axis_size=n), n)

        def mean_grads(grads, state):
            return reduce(grads, state, compressor)

        mean_grads = jax.jit(
            jax.shard_map(
                mean_grads, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp"))
            ),
            donate_argnums=1,
        )
        local = {"w": np.random.default_rng(rank).standard_normal((4096, 4096), np.float32)}
        grads = jax.tree.map(lambda g: jax.make_array_from_process_local_data(split, g), local)
        state = jax.tree.map(
            lambda s: jax.make_array_from_process_local_data(split, np.asarray(s)[:1]), state
        )
        holder = {"state": state}

        def run(steps):
            for _ in range(steps):
                mean, holder["state"] = mean_grads(grads, holder["state"])
            return mean

        return run

    def train(tx, **options):
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params, **options)
        holder = {"state": state}

        def run(steps):
            for _ in range(steps):
                holder["state"], loss = step(holder["state"], batch)
            return loss

        return run

    def phase_program(tx, warm: int):
        """Tuned, not the user's path: the phase's program called directly (no phase read per
        step, batch placed once): what the per-step phase read and placement cost."""
        step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
        for _ in range(warm):
            state, loss = step(state, batch)
        placed = jc.train.place_batch(batch, mesh, "dp")
        program = step.program(step.phases(state, placed))
        holder = {"state": state}

        def run(steps):
            for _ in range(steps):
                holder["state"], loss, *_ = program(holder["state"], placed)  # (skip report)
            return loss

        return run

    def local_adam():
        device = jax.local_devices()[0]
        opt = optax.adam(LR)

        def local_step(state, b):
            p, s = state
            loss, grads = jax.value_and_grad(loss_fn)(p, b)
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss

        state = jax.device_put((params, opt.init(params)), device)
        state = jax.tree.map(jnp.copy, state)
        b = jax.device_put(batch, device)
        fn = jax.jit(local_step, donate_argnums=(0,))
        holder = {"state": state}

        def run(steps):
            for _ in range(steps):
                holder["state"], loss = fn(holder["state"], b)
            return loss

        return run

    builders = {
        "readme_pmean": lambda: readme_block(lambda g, s, c: (lax.pmean(g, "dp"), s)),
        "readme_onebit": lambda: readme_block(
            lambda g, s, c: jc.compressed_pmean(g, s, axis_name="dp", compressor=c)
        ),
        "local": local_adam,
        "exact_adam": lambda: train(
            optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(LR))
        ),
        "onebit_adam": lambda: train(jc.onebit_adam(LR, freeze_step=4, axis_name="dp")),
        "onebit_adam_single": lambda: train(
            jc.onebit_adam(LR, freeze_step=4, axis_name="dp"), specialize_phases=False
        ),
        "exact_adam_unbounded": lambda: train(
            optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(LR)),
            max_in_flight=None,
        ),
        "onebit_adam_unbounded": lambda: train(
            jc.onebit_adam(LR, freeze_step=4, axis_name="dp"), max_in_flight=None
        ),
        "onebit_adam_program": lambda: phase_program(
            jc.onebit_adam(LR, freeze_step=4, axis_name="dp"), warm=8
        ),
        "zero_one_adam": lambda: train(jc.zero_one_adam(LR, axis_name="dp", total_steps=40)),
    }
    # past the freeze, into whole cycles
    warmup = {
        "onebit_adam": 8,
        "onebit_adam_single": 8,
        "onebit_adam_unbounded": 8,
        "zero_one_adam": 16,
    }
    names = [m for m in args.methods.split(",") if m]
    barrier = make_barrier(mesh)
    runs, compile_s = {}, {}
    for name in names:
        t0 = time.perf_counter()
        runs[name] = builders[name]()
        jax.block_until_ready(runs[name](warmup.get(name, 2)))
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            barrier()
            t0 = time.perf_counter()
            jax.block_until_ready(runs[name](args.steps))
            times[name].append((time.perf_counter() - t0) / args.steps)
    finish_worker(args, rank, {"rank": rank, "times": times, "compile_s": compile_s})


def _summarize(ranks: list[dict], args, shaped: bool) -> dict:
    from _two_ranks import provenance, slower_rank_medians

    step = slower_rank_medians(ranks)
    ratios = {}

    def ratio(key, a, b):
        if a in step and b in step:
            ratios[key] = step[a] / step[b]

    ratio("readme_onebit_speedup_vs_pmean", "readme_pmean", "readme_onebit")
    ratio("onebit_adam_speedup_vs_exact", "exact_adam", "onebit_adam")
    ratio("onebit_adam_over_local", "onebit_adam", "local")
    ratio("zero_one_adam_speedup_vs_exact", "exact_adam", "zero_one_adam")
    # The bound on queued steps (max_in_flight=2, the default) against none: its cost.
    ratio("exact_adam_bound_cost", "exact_adam", "exact_adam_unbounded")
    ratio("onebit_adam_bound_cost", "onebit_adam", "onebit_adam_unbounded")
    return {
        **provenance(),
        "rate": args.rate if shaped else "unshaped",
        "steps_per_round": args.steps,
        "repeats": args.repeats,
        "step_s": step,
        "compile_s": {k: max(r["compile_s"][k] for r in ranks) for k in step},
        "ratios": ratios,
    }


def _table(summary: dict) -> str:
    lines = [
        f"user's path, 2 processes, {summary['rate']}, median of {summary['repeats']} rounds of "
        f"{summary['steps_per_round']} unread steps, slower rank",
        f"{'method':<16} {'step ms':>9} {'compile s':>10}",
    ]
    for name, s in summary["step_s"].items():
        lines.append(f"{name:<16} {1e3 * s:9.1f} {summary['compile_s'][name]:10.1f}")
    for key, value in summary["ratios"].items():
        lines.append(f"{key:<34} {value:6.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    from _two_ranks import report_two_ranks

    return report_two_ranks(
        __file__, argv, args, prefix="user_path_", summarize=_summarize, table=_table
    )


if __name__ == "__main__":
    sys.exit(main())
