"""jaxcomm against PyTorch's DDP communication hooks, kind for kind, on one shaped link.

Two processes (gloo), each in its own network namespace, joined by a full-duplex link shaped
with ``tc tbf`` to ``--rate`` each way (``duplex.sh`` via ``benchmarks/_two_ranks.py``; ``--topo
lo``: one shaped loopback shared by both directions, the earlier setup), each
running both frameworks in the same process, rounds alternating between every leg, so both
see the same link and the same load. The model is one 4096 x 4096 fp32 weight (64 MiB of
gradient per process), a batch of 8 rows per process, loss ``sum((x W)^2)``:

* torch: ``DistributedDataParallel(gradient_as_bucket_view=True)`` with its default fp32
  all-reduce, ``fp16_compress_hook`` and ``powerSGD_hook`` (``PowerSGDState(rank 4,
  use_error_feedback=True, warm_start=True, start_powerSGD_iter=2)``), timed after PowerSGD's
  start; and the same forward/backward without DDP (``local``);
* jaxcomm: the same step in ``shard_map`` on JAX's default mesh, gradients averaged with
  ``lax.pmean`` (fp32), ``jc.compressed_pmean`` with ``jc.Cast(jnp.float16)``,
  ``jc.PowerSGD(rank=4)`` and ``jc.OneBit()``, state carried and donated; and the step with
  no communication (``local``).

Each round times ``--steps`` steps of one leg, then waits; the table gives medians over
``--repeats`` rounds (slower rank), each leg's step and its cost over its framework's local
step (the communication as the user feels it), and the ratios asked: jaxcomm's PowerSGD and fp16
against torch's, and jaxcomm's best against torch's best.

Needs ``torch`` next to jaxcomm in the same environment (``pip install torch``; not a jaxcomm
dependency). Usage (root, for duplex.sh's namespaces and ``tc``)::

    python benchmarks/torch_peer.py [--rate 1gbit] [--topo auto|lo] [--repeats 5] [--steps 3]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DIM, ROWS = 4096, 8
TORCH_LEGS = ("torch_local", "torch_fp32", "torch_fp16", "torch_powersgd")
JAX_LEGS = ("jax_local", "jax_fp32", "jax_fp16", "jax_powersgd", "jax_onebit")


def _parse(argv=None) -> argparse.Namespace:
    from _two_ranks import two_rank_parser

    p = two_rank_parser(__doc__.split("\n")[0], repeats_help="timed rounds per leg", timeout=1800.0)
    p.add_argument("--steps", type=int, default=3, help="steps per round (3)")
    return p.parse_args(argv)


def _torch_legs(rank: int, world: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(DIM, DIM, generator=gen) / DIM**0.5
    x = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1 + rank))

    def make(hook=None, state=None, ddp=True):
        model = torch.nn.Linear(DIM, DIM, bias=False)
        with torch.no_grad():
            model.weight.copy_(weight)
        if ddp:
            model = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=80)
            if hook is not None:
                model.register_comm_hook(state, hook)

        def step():
            model.zero_grad(set_to_none=False)
            loss = (model(x) ** 2).sum()
            loss.backward()
            return loss

        return step

    legs = {
        "torch_local": make(ddp=False),
        "torch_fp32": make(),
        "torch_fp16": make(default_hooks.fp16_compress_hook, None),
        "torch_powersgd": make(
            psgd.powerSGD_hook,
            psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=4,
                start_powerSGD_iter=2,
                min_compression_rate=2,
                use_error_feedback=True,
                warm_start=True,
            ),
        ),
    }

    def runner(step):
        def run(steps):
            for _ in range(steps):
                step()

        return run

    return {name: runner(step) for name, step in legs.items()}, dist


def _jax_legs(rank: int, world: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    # torch's store holds MASTER_PORT: JAX's coordinator takes the next port.
    address = f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    os.environ["JAX_COORDINATOR_BIND_ADDRESS"] = address
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=world,
        process_id=rank,
    )
    mesh = jax.make_mesh((world,), ("dp",))
    split = NamedSharding(mesh, P("dp"))
    rep = NamedSharding(mesh, P())
    gen = np.random.default_rng(0)
    weight_np = gen.standard_normal((DIM, DIM), np.float32) / np.float32(DIM**0.5)
    weight = jax.make_array_from_process_local_data(rep, weight_np)
    local_x = np.random.default_rng(1 + rank).standard_normal((ROWS, DIM), np.float32)
    x = jax.make_array_from_process_local_data(split, local_x)

    def loss(w, xb):
        return jnp.sum((xb @ w.T) ** 2)  # torch's Linear: x W^T

    def grads_of(w, xb):
        return jax.grad(loss)(jax.lax.pcast(w, "dp", to="varying"), xb)

    def leg(reduce, compressor=None):
        if compressor is None:
            body = lambda w, xb: reduce(grads_of(w, xb))  # noqa: E731
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P()))

            def run(steps):
                for _ in range(steps):
                    out = fn(weight, x)
                return out

            return run
        state = jc.stack_per_device(
            jc.init_state(compressor, {"w": weight}, axis_size=world), world
        )
        state = jax.tree.map(
            lambda s: jax.make_array_from_process_local_data(split, np.asarray(s)[:1]), state
        )

        def body(w, xb, s):
            return jc.compressed_pmean(
                {"w": grads_of(w, xb)}, s, axis_name="dp", compressor=compressor
            )

        fn = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=(P(), P("dp"))
            ),
            donate_argnums=2,
        )
        holder = {"state": state}

        def run(steps):
            for _ in range(steps):
                out, holder["state"] = fn(weight, x, holder["state"])
            return out

        return run

    legs = {
        "jax_local": _local_jax(weight, local_x, loss),  # no communication
        "jax_fp32": leg(lambda g: lax.pmean(g, "dp")),
        "jax_fp16": leg(None, jc.Cast(jnp.float16)),
        "jax_powersgd": leg(None, jc.PowerSGD(rank=4)),
        "jax_onebit": leg(None, jc.OneBit()),
    }

    def wrap(run):
        def timed(steps):
            jax.block_until_ready(run(steps))

        return timed

    return {name: wrap(run) for name, run in legs.items()}


def _local_jax(weight, local_x, loss):
    import jax

    device = jax.local_devices()[0]
    w = jax.device_put(weight.addressable_shards[0].data, device)
    xb = jax.device_put(local_x, device)
    fn = jax.jit(jax.grad(loss))

    def run(steps):
        for _ in range(steps):
            out = fn(w, xb)
        return out

    return run


def _worker(args: argparse.Namespace) -> None:
    from _two_ranks import launcher_env

    _, world, rank = launcher_env()  # torchrun's variables too, for torch's env:// start-up
    torch_legs, dist = _torch_legs(rank, world)
    jax_legs = _jax_legs(rank, world)
    legs = {**torch_legs, **jax_legs}

    def barrier():
        dist.barrier()

    compile_s = {}
    for name, run in legs.items():  # warm-up: compiles, DDP buckets, PowerSGD past its start
        t0 = time.perf_counter()
        run(4)
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in legs}
    for _ in range(args.repeats):
        for name, run in legs.items():
            barrier()
            t0 = time.perf_counter()
            run(args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps({"times": times}))
    dist.destroy_process_group()


def _summarize(ranks: list[dict], args, shaped: bool) -> dict:
    import torch
    from _two_ranks import provenance, slower_rank_medians

    step = slower_rank_medians(ranks)
    over = {
        n: step[n] - step["torch_local" if n.startswith("torch") else "jax_local"]
        for n in step
        if not n.endswith("_local")
    }
    best_torch = min(step[n] for n in ("torch_fp16", "torch_powersgd"))
    best_jax = min(step[n] for n in ("jax_fp16", "jax_powersgd", "jax_onebit"))
    ratios = {
        "powersgd_torch_over_jax": step["torch_powersgd"] / step["jax_powersgd"],
        "fp16_torch_over_jax": step["torch_fp16"] / step["jax_fp16"],
        "best_torch_over_best_jax": best_torch / best_jax,
    }
    return {
        **provenance(torch=torch.__version__),
        "rate": args.rate if shaped else "unshaped",
        "repeats": args.repeats,
        "steps_per_round": args.steps,
        "step_s": step,
        "over_local_s": over,
        "ratios": ratios,
    }


def _table(summary: dict) -> str:
    lines = [
        f"torch DDP hooks vs jaxcomm, 2 processes, {summary['rate']}, 64 MiB fp32 gradient, "
        f"median of {summary['repeats']} rounds, slower rank",
        f"{'leg':<16} {'step ms':>9} {'over local ms':>14}",
    ]
    for name, s in summary["step_s"].items():
        extra = summary["over_local_s"].get(name)
        cost = f"{1e3 * extra:14.1f}" if extra is not None else f"{'':>14}"
        lines.append(f"{name:<16} {1e3 * s:9.1f} {cost}")
    for key, value in summary["ratios"].items():
        lines.append(f"{key:<28} {value:6.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    from _two_ranks import report_two_ranks

    return report_two_ranks(
        __file__, argv, args, prefix="torch_peer_", summarize=_summarize, table=_table
    )


if __name__ == "__main__":
    sys.exit(main())
