"""A/B of two versions of jaxcomm in one run: the train step of this checkout against a commit.

This machine's speed moves by 5-10% between runs (and within one), more than most changes
measure, so comparing two runs of ``train_step_1gbit.py`` says little. Here both versions are
imported side by side in the same two processes (the base commit's ``jaxcomm`` package is
exported with ``git archive`` and renamed ``jaxcomm_base``), every method is built from each,
and the timed rounds alternate between them (the order reversed every other round), so a
burst of load hits both alike. A step's time is the slower rank's; the table shows medians
and the ratio of this checkout to the base. The local Adam step (no communication) is timed
in the same rounds, as the floor.

Usage (root, for duplex.sh's namespaces and ``tc``, as the other shaped benchmarks: a
full-duplex link of ``--rate`` each way; ``--topo lo``: one shaped loopback for both directions)::

    python benchmarks/ab_train_step.py --base HEAD~1 [--methods onebit_adam_phased,...]
                                       [--model mlp|transformer] [--repeats 9] [--topo auto|lo]

A method is a name of ``train_step_1gbit.py``'s ``make_tx`` (``cmean_onebit``, ``onebit_adam``,
``zero_one_adam``, ``onebit_lamb``, ``sharded_int8``, ``diloco_int4``, ...), with ``_phased``
for ``make_train_step(..., specialize_phases=True)``. Cycled methods (0/1 Adam, DiLoCo) are
timed step by step here, not per cycle.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for path in (REPO, HERE):
    if str(path) not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, str(path))

BASE_NAME = "jaxcomm_base"
WARMUP = 5  # past the freeze (2) and the first compressed step of every method


def export_base(rev: str, into: Path) -> str:
    """Write ``rev``'s ``jaxcomm`` package as ``into/jaxcomm_base``; returns the commit hash."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "jaxcomm"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / BASE_NAME
    (into / "jaxcomm").rename(package)
    # Absolute imports and dotted names of the package become those of the renamed one.
    pattern = re.compile(r"\b(from jaxcomm\b|import jaxcomm\b|jaxcomm\.)")
    for source in package.rglob("*.py"):
        text = source.read_text()
        source.write_text(pattern.sub(lambda m: m.group(0).replace("jaxcomm", BASE_NAME), text))
    return commit


def _worker(args: argparse.Namespace) -> None:
    import json
    import os

    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    sys.path.insert(0, args.base_dir)
    import importlib

    import jax
    import numpy as np
    import train_step_1gbit as T
    from _two_ranks import launcher_env
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    launcher_env()  # under duplex.sh: torchrun's variables, which init_distributed reads
    info = jc.init_distributed("gloo", initialization_timeout=120)
    base = importlib.import_module(BASE_NAME)
    rank = info.process_id
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    split = NamedSharding(mesh, P("dp"))
    make_model = T.make_mlp if args.model == "mlp" else T.make_transformer
    params, loss_fn, local_batch = make_model(args, rank)
    batch = jax.tree.map(lambda a: jax.make_array_from_process_local_data(split, a), local_batch)
    token = jax.make_array_from_process_local_data(split, np.ones((1,), np.float32))
    barrier = jax.jit(
        jax.shard_map(lambda t: lax.psum(t, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    )

    local_fn, local_state, local_on_device = T.local_adam_step(loss_fn, params, local_batch)
    holders = {"local": {"state": local_state}}
    runners = {"local": (local_fn, local_on_device)}
    for method in args.methods.split(","):
        name = method.removesuffix("_phased")
        for label, lib in (("base", base), ("new", jc)):
            tx = T.make_tx(name, "dp", args.bucket_bytes, jc=lib)
            step, state = lib.make_train_step(
                mesh, "dp", loss_fn, tx, params, specialize_phases=method.endswith("_phased")
            )
            holders[f"{method}:{label}"] = {"state": state}
            runners[f"{method}:{label}"] = (step, batch)

    def run(key):
        fn, b = runners[key]
        holders[key]["state"], loss = fn(holders[key]["state"], b)
        jax.block_until_ready((holders[key]["state"], loss))

    keys = list(runners)
    for key in keys:
        for _ in range(WARMUP):
            barrier(token).block_until_ready()
            run(key)
    times = {key: [] for key in keys}
    for i in range(args.repeats):
        for key in keys if i % 2 == 0 else keys[::-1]:
            barrier(token).block_until_ready()
            t0 = time.perf_counter()
            run(key)
            times[key].append(time.perf_counter() - t0)
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(times))


def main(argv: list[str] | None = None) -> int:
    import train_step_1gbit as T
    from _two_ranks import add_link_options, describe_link, link_record, run_two_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="the commit to compare with (HEAD)")
    p.add_argument("--methods", default="onebit_adam,onebit_adam_phased", help="comma list")
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (9)")
    add_link_options(p)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--base-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model = T._parse(["--model", args.model])  # the benchmark's model sizes and buckets
    for key in ("width", "layers", "batch", "bucket_bytes"):
        setattr(args, key, getattr(model, key))
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="jaxcomm-ab-") as base_dir:
        commit = export_base(args.base, Path(base_dir))
        worker_args = ["--base-dir", base_dir, "--methods", args.methods]
        worker_args += ["--model", args.model, "--repeats", str(args.repeats)]
        ranks = run_two_ranks(
            __file__,
            worker_args,
            rate=args.rate,
            shaped=not args.no_shape,
            timeout=args.timeout,
            prefix="jaxcomm-ab-out-",
            topo=args.topo,
            duplex=args.duplex,
        )
    if ranks is None:
        return 0
    import numpy as np

    slower = {k: np.maximum(ranks[0][k], ranks[1][k]) for k in ranks[0]}
    med = {k: float(np.median(v)) * 1e3 for k, v in slower.items()}
    print(f"base {commit[:10]} vs this checkout; {args.model}, median of {args.repeats} rounds")
    print(describe_link(link_record(args)))
    print(f"{'method':28s} {'base (ms)':>10s} {'new (ms)':>10s} {'new/base':>9s}")
    print(f"{'local Adam step (floor)':28s} {med['local']:10.1f}")
    for method in args.methods.split(","):
        b, n = med[f"{method}:base"], med[f"{method}:new"]
        print(f"{method:28s} {b:10.1f} {n:10.1f} {n / b:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
