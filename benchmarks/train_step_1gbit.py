"""Train-step time of every jaxcomm data-parallel method at 1 Gbit/s, against exact Adam.

Two processes (one CPU device each, gloo collectives over TCP), each in its own network
namespace, joined by a full-duplex link shaped with ``tc tbf`` to ``--rate`` each way
(``duplex.sh`` via the shared driver ``benchmarks/_two_ranks.py``, as ``compressors_1gbit.py``
and ``sharded_1gbit.py``; ``--topo lo``: one shaped loopback for both directions, the earlier
setup). Each
process trains the same model on its own batch through ``jc.make_train_step`` (state donated
and carried from step to step), one method after the other:

* ``local``: the floor of any method: loss, gradients and an ``optax.adam`` step jitted on the
  process's own device, nothing sent (state donated);
* ``local_sync``: ``local`` followed by one scalar all-reduce, in the timed step: what a
  data-parallel step pays at least, since its ranks meet at every collective (every
  ``make_train_step`` step averages the loss): the wait for the slower rank. On one machine
  shared by both ranks their steps drift apart by several ms (a scalar all-reduce alone takes
  0.25 ms);
* ``wire_1bit``: the other floor: only the 1-bit payload of the whole model (the packed signs'
  ``all_to_all`` and ``all_gather``, uint8, as ``jc.OneBit`` sends them), no compute;
* ``exact``: ``optax.chain(jc.compressed_mean(axis, jc.NoCompression()), optax.adam(lr))``;
* ``cmean_onebit``: ``optax.chain(jc.compressed_mean(axis, jc.OneBit()), optax.adam(lr))``;
* ``onebit_adam``: ``jc.onebit_adam(freeze_step=2)`` timed after its freeze (compressed steps;
  the warm-up branch is compiled in, as in real use);
* ``onebit_adam_nocond``: the same with ``freeze_step=0`` (only the compressed branch compiled,
  ``v`` set to ones): the difference to ``onebit_adam`` is the cost of the ``lax.cond``;
* ``zero_one_adam``: ``jc.zero_one_adam(var_freeze_step=2, local_step_scaler=1,
  local_step_clipper=16)``: the sync interval doubles each frozen step up to 16, so a cycle is
  15 local steps (nothing sent) and one 1-bit synchronisation; the row is the mean step over a
  whole cycle (``zero_one_local`` and ``zero_one_sync`` give the two kinds apart);
* ``onebit_lamb``: ``jc.onebit_lamb(freeze_step=2)`` after its freeze;
* ``sharded_int8``: ``jc.sharded(optax.adam(lr), axis, compressor=jc.Quantize(bits=8),
  gather_compressor=jc.Quantize(bits=8))`` (ZeRO 1-2 with int8 gradients and weights);
* ``diloco_int4``: ``jc.diloco(optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True),
  16, axis, compressor=jc.Quantize(bits=4, error_feedback=True))``, the mean step over a whole
  cycle of ``H = 16`` (15 inner steps that send nothing, one sync of the int4 outer gradient;
  ``diloco_int4_local`` / ``_sync`` apart). The papers' ``H`` of 50-500 amortises the sync
  further.
* ``onebit_adam_phased``, ``zero_one_adam_phased``, ``diloco_int4_phased``: the same three
  with ``jc.make_train_step(..., specialize_phases=True)``: each phase of the schedule is its
  own program, chosen on the host per step (:mod:`jaxcomm.train.phased`; a probe reads the step
  count first, which is in the timed step).

Models (``--model``): ``mlp``, ``--layers`` x (``--width`` x ``--width`` + bias), 16.8M fp32
parameters (64 MiB) by default, batch 16 per process; ``transformer``, a pre-LN decoder of the
same size class (d 512, 4 layers, vocabulary 4096, 16.8M parameters in 69 leaves), batch 4 x 64
tokens per process, every method run with ``--bucket-bytes`` (default 4 MiB for it).

Timing: 4 warm-up steps per method (0/1 Adam: until its interval reached 16 and a cycle ended),
then ``--repeats`` rounds that time one step of every method in turn (0/1 Adam: one whole cycle)
so a burst of load on the shared machine hits all methods alike; every step is preceded by a
barrier (a tiny cross-process psum) so that both ranks start together; a step's time is the
slower rank's; the table shows medians and the speedup against ``exact``. ``exact`` is timed in
rounds of its own, after the others: interleaved, its 1.2 s steps (mostly waiting on the wire)
made every compressed method timed after it in the same round 10-20% slower on the 2-core VM
this was written on (1-bit Adam phased 1.44x -> 1.22x of local + wire, ``onebit_lamb`` 362 ->
298 ms, with ``exact`` left out of the rounds), though a user's process runs one method. Bytes
on the wire per device per step come from the compiled HLO (``jaxcomm.inspect.wire_bytes``).

Usage (root, for duplex.sh's namespaces and ``tc``; ``--no-shape`` runs on the unshaped
loopback)::

    python benchmarks/train_step_1gbit.py [--model mlp|transformer] [--rate 1gbit] [--topo auto|lo]
                                          [--repeats 5] [--methods exact,onebit_adam,...]
                                          [--bucket-bytes N] [--no-shape] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

# Warm-up steps per method: past the freeze and the first compressed step (1-bit Adam's
# phased step compiles a program for it, and another for the steps after it).
WARMUP = 4
FREEZE = 2  # warm-up steps of the 1-bit optimizers: the timed steps are all compressed
ZO_CLIPPER = 16  # 0/1 Adam's sync interval in the timed cycles (DeepSpeed's default clipper)
DILOCO_H = 16  # DiLoCo's sync_every in the timed cycles (the papers use 50-500: fewer syncs)

METHODS = {
    "local": "local Adam step, nothing sent (floor)",
    "local_sync": "local Adam step + the ranks meet once",
    "wire_1bit": "1-bit payload only, no compute (floor)",
    "exact": "exact: compressed_mean(NoCompression)+adam",
    "cmean_onebit": "compressed_mean(OneBit)+adam",
    "onebit_adam": "onebit_adam, compressed phase",
    "onebit_adam_nocond": "onebit_adam, freeze_step=0 (no cond)",
    "zero_one_adam": f"zero_one_adam, mean of a {ZO_CLIPPER}-step cycle",
    "onebit_lamb": "onebit_lamb, compressed phase",
    "sharded_int8": "sharded(adam), int8 grads + int8 weights",
    "diloco_int4": f"diloco(adam, nesterov), int4+EF, mean of H={DILOCO_H}",
    "onebit_adam_phased": "onebit_adam, specialize_phases=True",
    "zero_one_adam_phased": "zero_one_adam, specialize_phases=True",
    "diloco_int4_phased": "diloco_int4, specialize_phases=True",
}
#: Methods run with ``make_train_step(..., specialize_phases=True)``: name -> the method.
PHASED = {f"{m}_phased": m for m in ("onebit_adam", "zero_one_adam", "diloco_int4")}
#: Rows derived from the cycled methods (not methods of their own).
DERIVED = {
    "zero_one_local": "  0/1 Adam local step (nothing sent)",
    "zero_one_sync": "  0/1 Adam sync step (1-bit)",
    "diloco_int4_local": "  DiLoCo inner step (nothing sent)",
    "diloco_int4_sync": "  DiLoCo sync step (int4 outer gradient)",
    "zero_one_phased_local": "  0/1 Adam local step, phased",
    "zero_one_phased_sync": "  0/1 Adam sync step, phased",
    "diloco_int4_phased_local": "  DiLoCo inner step, phased",
    "diloco_int4_phased_sync": "  DiLoCo sync step, phased",
}
#: Methods timed over whole sync cycles: name -> prefix of their derived rows.
CYCLES = {
    "zero_one_adam": "zero_one",
    "diloco_int4": "diloco_int4",
    "zero_one_adam_phased": "zero_one_phased",
    "diloco_int4_phased": "diloco_int4_phased",
}


def make_tx(name: str, axis: str, bucket_bytes: int | None, lr: float = 1e-3, *, jc=None):
    """The optax transformation of method ``name``, as user code writes it (``jc``: the package
    to take it from, default ``jaxcomm``; ``ab_train_step.py`` passes another version)."""
    import optax

    if jc is None:
        import jaxcomm as jc

    adam = optax.adam(lr)
    bb = dict(bucket_bytes=bucket_bytes)
    if name == "exact":
        return optax.chain(jc.compressed_mean(axis, jc.NoCompression(), **bb), adam)
    if name == "cmean_onebit":
        return optax.chain(jc.compressed_mean(axis, jc.OneBit(), **bb), adam)
    if name == "onebit_adam":
        return jc.onebit_adam(lr, freeze_step=FREEZE, axis_name=axis, **bb)
    if name == "onebit_adam_nocond":
        return jc.onebit_adam(lr, freeze_step=0, axis_name=axis, **bb)
    if name == "zero_one_adam":
        return jc.zero_one_adam(
            lr,
            var_freeze_step=FREEZE,
            local_step_scaler=1,
            local_step_clipper=ZO_CLIPPER,
            axis_name=axis,
            **bb,
        )
    if name == "onebit_lamb":
        return jc.onebit_lamb(lr, freeze_step=FREEZE, axis_name=axis, **bb)
    if name == "sharded_int8":
        q8 = jc.Quantize(bits=8)
        return jc.sharded(adam, axis, compressor=q8, gather_compressor=q8, **bb)
    if name == "diloco_int4":
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        q4 = jc.Quantize(bits=4, error_feedback=True)
        return jc.diloco(adam, outer, DILOCO_H, axis, compressor=q4, **bb)
    raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from _two_ranks import two_rank_parser

    p = two_rank_parser(__doc__, methods=METHODS, repeats_help="timed rounds")
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp", help="(mlp)")
    p.add_argument("--width", type=int, default=2048, help="MLP hidden width (2048)")
    p.add_argument("--layers", type=int, default=4, help="MLP width x width layers (4)")
    p.add_argument("--batch", type=int, default=None, help="examples per process (mlp 16, tr 4)")
    p.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="bucket_bytes of every method (mlp: None, one bucket; transformer: 4 MiB)",
    )
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 16 if args.model == "mlp" else 4
    if args.bucket_bytes is None and args.model == "transformer":
        args.bucket_bytes = 4 << 20
    return args


# --------------------------------------------------------------------------------------------
# Models (the same initial parameters on every process; each process has its own batch).
# --------------------------------------------------------------------------------------------


def make_mlp(args, rank: int):
    from _two_ranks import mlp

    return mlp(args.width, args.layers, args.batch, rank)


TRANSFORMER = dict(d=512, layers=4, vocab=4096, seq=64, heads=8)


def make_transformer(args, rank: int):
    """A pre-LN decoder-only transformer, separate q/k/v/o and MLP leaves (69 leaves)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    cfg = TRANSFORMER
    d, vocab, seq, heads = cfg["d"], cfg["vocab"], cfg["seq"], cfg["heads"]
    rng = np.random.default_rng(0)

    def dense(fan_in, fan_out):
        return (rng.standard_normal((fan_in, fan_out), np.float32) / np.sqrt(fan_in)).astype(
            np.float32
        )

    def ln():
        return {"scale": np.ones((d,), np.float32), "bias": np.zeros((d,), np.float32)}

    params = {
        "embed": (rng.standard_normal((vocab, d), np.float32) * 0.02).astype(np.float32),
        "pos": (rng.standard_normal((seq, d), np.float32) * 0.02).astype(np.float32),
        "final_ln": ln(),
        "head": dense(d, vocab),
    }
    for i in range(cfg["layers"]):
        params[f"block{i}"] = {
            "ln1": ln(),
            "ln2": ln(),
            **{f"w{k}": dense(d, d) for k in "qkvo"},
            **{f"b{k}": np.zeros((d,), np.float32) for k in "qkvo"},
            "w1": dense(d, 4 * d),
            "b1": np.zeros((4 * d,), np.float32),
            "w2": dense(4 * d, d),
            "b2": np.zeros((d,), np.float32),
        }

    def layer_norm(x, p):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def loss_fn(p, tokens):
        b, s = tokens.shape
        x = p["embed"][tokens] + p["pos"][None, :s]
        mask = jnp.tril(jnp.ones((s, s), bool))
        for i in range(cfg["layers"]):
            blk = p[f"block{i}"]
            h = layer_norm(x, blk["ln1"])

            def proj(k, h=h, blk=blk):
                y = h @ blk[f"w{k}"] + blk[f"b{k}"]
                return y.reshape(b, s, heads, d // heads)

            q, k, v = proj("q"), proj("k"), proj("v")
            att = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            y = jnp.einsum("bhqk,bkhc->bqhc", att, v).reshape(b, s, d)
            x = x + y @ blk["wo"] + blk["bo"]
            h = layer_norm(x, blk["ln2"])
            x = x + jax.nn.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"]
        logits = layer_norm(x, p["final_ln"]) @ p["head"]
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    data = np.random.default_rng(1 + rank)
    batch = data.integers(0, vocab, (args.batch, seq), dtype=np.int32)
    return params, loss_fn, batch


# --------------------------------------------------------------------------------------------
# Worker (one per rank).
# --------------------------------------------------------------------------------------------


def local_adam_step(loss_fn, params, local_batch):
    """The floor of every method: ``optax.adam`` on this process's device, nothing sent.

    Returns the compiled step (state donated), its state ``(params, adam state)`` and the
    batch, both on the device.
    """
    import jax
    import optax

    adam = optax.adam(1e-3)

    def local_step(state, batch):
        p, opt = state
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt = adam.update(grads, opt, p)
        return (optax.apply_updates(p, updates), opt), loss

    device = jax.local_devices()[0]
    lparams = jax.device_put(params, device)
    state = (lparams, jax.jit(adam.init)(lparams))
    batch = jax.device_put(local_batch, device)
    return jax.jit(local_step, donate_argnums=(0,)).lower(state, batch).compile(), state, batch


def _host_int(x) -> int:
    """A replicated scalar of the global state, read on this process."""
    import numpy as np

    return int(np.asarray(x.addressable_data(0)))


def _worker(args: argparse.Namespace) -> None:
    from _two_ranks import barrier as make_barrier
    from _two_ranks import finish_worker, start_gloo

    rank, n, mesh = start_gloo()  # before JAX is imported: one CPU device per process
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc
    from jaxcomm.inspect import wire_bytes

    split = NamedSharding(mesh, P("dp"))
    make_model = make_mlp if args.model == "mlp" else make_transformer
    params, loss_fn, local_batch = make_model(args, rank)
    leaves = jax.tree.leaves(params)
    numel = sum(x.size for x in leaves)
    batch = jax.tree.map(lambda a: jax.make_array_from_process_local_data(split, a), local_batch)
    barrier = make_barrier(mesh)

    names = [m for m in args.methods.split(",") if m]
    for name in names:
        if name not in METHODS:
            raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    runners, wire, compile_s, losses = {}, {}, {}, {}

    for name in names:
        t0 = time.perf_counter()
        if name in ("local", "local_sync"):
            fn, lstate, lbatch = local_adam_step(loss_fn, params, local_batch)
            wire[name] = wire_bytes(fn.as_text())
            holder = {"state": lstate}

            def run(fn=fn, holder=holder, lbatch=lbatch, name=name):
                holder["state"], loss = fn(holder["state"], lbatch)
                jax.block_until_ready((holder["state"], loss))
                if name == "local_sync":  # the ranks meet, as every collective makes them
                    barrier()
                return float(loss)

        elif name == "wire_1bit":
            padded = -(-numel // (8 * n)) * 8 * n
            signs = jax.make_array_from_process_local_data(
                split, np.zeros((n, padded // 8 // n), np.uint8)
            )

            def payload(s):
                got = lax.all_to_all(s, "dp", 0, 0, tiled=True)
                server = lax.all_gather(got[:1], "dp", tiled=True)
                return got + server.sum(0, keepdims=True, dtype=jnp.uint8)

            fn = (
                jax.jit(
                    jax.shard_map(payload, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")),
                    donate_argnums=(0,),
                )
                .lower(signs)
                .compile()
            )
            wire[name] = wire_bytes(fn.as_text())
            holder = {"state": signs}

            def run(fn=fn, holder=holder):
                holder["state"] = fn(holder["state"])
                holder["state"].block_until_ready()
                return 0.0

        elif name in PHASED:  # compiled per phase on first use; wire bytes after the run
            tx = make_tx(PHASED[name], "dp", args.bucket_bytes)
            step, state = jc.make_train_step(
                mesh, "dp", loss_fn, tx, params, specialize_phases=True
            )
            holder = {"state": state, "step": step}

            def run(step=step, holder=holder):
                holder["state"], loss = step(holder["state"], batch)
                jax.block_until_ready((holder["state"], loss))
                return float(loss)

        else:
            tx = make_tx(name, "dp", args.bucket_bytes)
            step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
            if name == "onebit_adam_nocond":
                # Compressed from the first step, v was never warmed up: give it ones so the
                # steps stay finite (v = 0 makes m / eps huge, and denormals slow CPUs down).
                opt = state.opt_state
                like = jax.tree.map(lambda x: x.sharding, opt.nu)
                ones = jax.jit(lambda t: jax.tree.map(jnp.ones_like, t), out_shardings=like)
                state = state._replace(opt_state=opt._replace(nu=ones(opt.nu)))
            fn = step.lower(state, batch).compile()
            wire[name] = wire_bytes(fn.as_text())
            holder = {"state": state}

            def run(fn=fn, holder=holder):
                holder["state"], loss = fn(holder["state"], batch)
                jax.block_until_ready((holder["state"], loss))
                return float(loss)

        compile_s[name] = time.perf_counter() - t0
        runners[name], losses[name] = (run, holder), []

    def next_is_sync(name, holder) -> bool:
        """Whether the next step of a cycled method synchronises."""
        opt = holder["state"].opt_state
        count = _host_int(opt.count)
        if PHASED.get(name, name) == "zero_one_adam":
            return (count + 1) % _host_int(opt.local_interval) == 0
        return (count + 1) % DILOCO_H == 0

    def cycle(name, run, holder, times):
        """One whole sync cycle: (step time, kind) of each step, ending with a sync step."""
        kinds = []
        while True:
            sync = next_is_sync(name, holder)
            times.append(barrier())
            t0 = time.perf_counter()
            run()
            kinds.append((time.perf_counter() - t0, "sync" if sync else "local"))
            if sync:
                return kinds

    times: dict[str, list] = {name: [] for name in names}
    times["barrier"] = []
    for name in names:
        run, holder = runners[name]
        for _ in range(WARMUP):
            barrier()
            losses[name].append(run())
        if PHASED.get(name, name) == "zero_one_adam":  # until the interval reached its cap
            while True:
                opt = holder["state"].opt_state
                interval, count = _host_int(opt.local_interval), _host_int(opt.count)
                if interval == ZO_CLIPPER and count % interval == 0:
                    break
                barrier()
                losses[name].append(run())
        if PHASED.get(name, name) == "diloco_int4":  # until a cycle ended
            while _host_int(holder["state"].opt_state.count) % DILOCO_H:
                barrier()
                losses[name].append(run())
    # Rounds: a burst of load hits every method alike. The exact step, mostly idle on the
    # wire, slowed the methods after it in its round (see the module docstring): its own rounds.
    blocks = [[m for m in names if m != "exact"], [m for m in names if m == "exact"]]
    for block in blocks:
        for _ in range(args.repeats if block else 0):
            for name in block:
                run, holder = runners[name]
                if name in CYCLES:
                    times[name].append(cycle(name, run, holder, times["barrier"]))
                    continue
                times["barrier"].append(barrier())
                t0 = time.perf_counter()
                losses[name].append(run())
                times[name].append(time.perf_counter() - t0)
    for name in names:
        print(f"rank {rank} {name}: {times[name]}"[:400], flush=True)
        if name in PHASED:  # the program of its last timed step (compressed, or a sync)
            step, state = runners[name][1]["step"], runners[name][1]["state"]
            program = step.program(step.last_phases)
            wire[name] = wire_bytes(program.lower(state, batch).compile().as_text())
    result = dict(
        rank=rank,
        num_processes=n,
        numel=numel,
        leaves=len(leaves),
        times=times,
        wire=wire,
        compile_s=compile_s,
        losses=losses,
    )
    finish_worker(args, rank, result, barrier)


# --------------------------------------------------------------------------------------------
# Launcher side.
# --------------------------------------------------------------------------------------------


def _summarize(ranks: list[dict], args: argparse.Namespace, shaped: bool) -> dict:
    repeats = args.repeats
    names = [k for k in ranks[0]["times"] if k != "barrier"]
    medians: dict[str, float] = {}
    for name in names:
        if name in CYCLES:
            prefix = CYCLES[name]
            cycles, local, sync = [], [], []
            for i in range(repeats):
                per_rank = [r["times"][name][i] for r in ranks]
                steps = [max(s[j][0] for s in per_rank) for j in range(len(per_rank[0]))]
                kinds = [k for _, k in per_rank[0]]
                cycles.append(sum(steps) / len(steps))
                local += [t for t, k in zip(steps, kinds, strict=True) if k == "local"]
                sync += [t for t, k in zip(steps, kinds, strict=True) if k == "sync"]
            medians[name] = statistics.median(cycles)
            if local:
                medians[f"{prefix}_local"] = statistics.median(local)
            medians[f"{prefix}_sync"] = statistics.median(sync)
        else:
            # A step is done when its slowest participant is.
            per_run = [max(r["times"][name][i] for r in ranks) for i in range(repeats)]
            medians[name] = statistics.median(per_run)
    barrier = statistics.median(
        max(vals) for vals in zip(*(r["times"]["barrier"] for r in ranks), strict=True)
    )
    base = medians.get("exact")
    floor = None
    if "local" in medians and "wire_1bit" in medians:
        floor = medians["local"] + medians["wire_1bit"]
    return {
        "model": args.model,
        "numel": ranks[0]["numel"],
        "leaves": ranks[0]["leaves"],
        "batch": args.batch,
        "bucket_bytes": args.bucket_bytes,
        "num_processes": ranks[0]["num_processes"],
        "rate": args.rate if shaped else None,
        "repeats": repeats,
        "median_s": medians,
        "barrier_median_s": barrier,
        "speedup_vs_exact": {k: base / v for k, v in medians.items()} if base else {},
        "local_plus_wire_s": floor,
        "vs_local_plus_wire": {k: v / floor for k, v in medians.items()} if floor else {},
        "wire_bytes_per_device": ranks[0]["wire"],
        "compile_s": ranks[0]["compile_s"],
        "losses_rank0": ranks[0]["losses"],
        "times_s": {r["rank"]: r["times"] for r in ranks},
    }


def _table(s: dict) -> str:
    link = s["rate"] or "unshaped loopback"
    rows = [
        f"{s['num_processes']} processes, {s['model']} of {s['numel'] / 1e6:.1f}M fp32 params "
        f"({s['leaves']} leaves), batch {s['batch']}/process, bucket_bytes={s['bucket_bytes']}, "
        f"link: {link}, median of {s['repeats']} rounds, slower rank "
        f"(barrier {s['barrier_median_s'] * 1e3:.1f} ms)",
        f"{'method':<46}{'step (ms)':>10}{'wire/device*':>14}{'vs exact':>10}{'/(local+wire)':>14}",
    ]
    labels = {**METHODS, **DERIVED}
    for name, median in s["median_s"].items():
        speed = s["speedup_vs_exact"].get(name)
        ratio = s["vs_local_plus_wire"].get(name)
        w = s["wire_bytes_per_device"].get(name)
        rows.append(
            f"{labels[name]:<46}{median * 1e3:>10.1f}"
            + (f"{w / 2**20:>10.2f} MiB" if w is not None else f"{'':>14}")
            + (f"{speed:>9.2f}x" if speed else f"{'':>10}")
            + (f"{ratio:>13.2f}x" if ratio else "")
        )
    if s["local_plus_wire_s"]:
        rows.append(f"local step + 1-bit wire time = {s['local_plus_wire_s'] * 1e3:.1f} ms")
    sync = s["median_s"].get("local_sync")
    if sync and "wire_1bit" in s["median_s"]:
        both = sync + s["median_s"]["wire_1bit"]
        rows.append(f"local step + meeting + 1-bit wire time = {both * 1e3:.1f} ms")
    rows.append(
        "* every collective of the compiled step, both branches of a lax.cond/switch "
        "(phased: of the program of its last timed step, compressed or a sync)"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0

    from _two_ranks import report_two_ranks

    return report_two_ranks(
        __file__,
        argv,
        args,
        prefix="jaxcomm-train-step-",
        summarize=_summarize,
        table=_table,
    )


if __name__ == "__main__":
    sys.exit(main())
