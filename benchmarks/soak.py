"""Soak: 2 processes under ``jaxcomm launch``, 1-bit Adam, checkpoints, one kill and a restart.

Each rank trains an MLP (teacher regression, 16 -> 64 -> 16) with ``jc.onebit_adam`` through
``jc.make_train_step`` on a mesh of the 2 processes' CPU devices (gloo; on the loopback shaped
to ``--rate`` by ``tc`` when root can, else unshaped). Every ``--ckpt-every`` steps each rank
writes its part of the :class:`jaxcomm.TrainState` (replicated leaves and its own rows of the
per-device error feedback) and the data position to ``rank{r}/step{t}.npz`` (written to a
temporary name, then renamed: a kill never leaves half a checkpoint). At step ``--kill-at``
rank 1 SIGKILLs itself once; the launcher tears rank 0 down and exits non-zero; the driver
starts the launcher again and both ranks resume from the newest step that *both* saved.

Checked and reported (JSON on stdout, with ``--json PATH`` also to a file):

* no lost step: the run ends at ``--steps``; the resumed step counter (the optimizer's
  ``count``) and data position equal the checkpoint's step; the step records after the restart
  start exactly at checkpoint + 1; with ``--reference`` the losses of the killed-and-resumed
  run equal those of an uninterrupted run bit for bit.
* memory: each rank's RSS at the start (after the first step), middle and end.
* error feedback: ``|e_w| / |m|`` (the 1-bit worker residual relative to the momentum it
  compresses: ``m / denom`` with ``jc.onebit_adam``'s default preconditioning, see
  :func:`compressed_momentum`) and ``|e_w| / |g|`` (relative to the gradient), sampled over
  the run.

    python benchmarks/soak.py [--steps 20000] [--ckpt-every 1000] [--kill-at 10500]
        [--rate 1gbit] [--reference] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IN, HIDDEN, OUT, BATCH = 16, 64, 16, 32  # BATCH per rank


# --------------------------------------------------------------------------------------------
# Worker (one rank; run by `jaxcomm launch`).


B2, EPS, VARIANCE_FLOOR = 0.999, 1e-8, 0.1  # jc.onebit_adam's defaults, as the soak runs it


def compressed_momentum(mu, nu, freeze_step: int):
    """What 1-bit Adam's all-reduce compresses after the freeze, for one leaf: ``m / denom``
    (default ``precondition``), ``denom = max(sqrt(v_hat), floor * sqrt(mean(v_hat))) + eps``
    with ``v_hat = v / (1 - b2^freeze_step)`` (the frozen, bias-corrected variance)."""
    import numpy as np

    m = np.asarray(mu.addressable_data(0), np.float64)
    v = np.asarray(nu.addressable_data(0), np.float64) / (1 - B2**freeze_step)
    denom = np.maximum(np.sqrt(v), VARIANCE_FLOOR * np.sqrt(np.mean(v))) + EPS
    return m / denom


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    info = jc.init_distributed()
    rank, n = info.process_id, info.num_processes
    out = Path(args.out)
    ckpt_dir = out / f"rank{rank}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))

    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b1": np.zeros((HIDDEN,), np.float32),
        "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
    }
    teacher = (rng.normal(size=(IN, OUT)) / np.sqrt(IN)).astype(np.float32)

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def data(position: int):
        """The global batch number ``position`` (a pure function of it: resumable exactly)."""
        r = np.random.default_rng((1, position))
        x = r.normal(size=(n * BATCH, IN)).astype(np.float32)
        y = np.sin(x @ teacher) + 0.05 * r.normal(size=(n * BATCH, OUT)).astype(np.float32)
        return x, y

    tx = jc.onebit_adam(1e-3, b2=B2, freeze_step=args.freeze_step, axis_name="dp")
    step, state = jc.make_train_step(mesh, "dp", loss_fn, tx, params)
    specs = jc.train_state_specs(state, "dp")
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    batch_sharding = NamedSharding(mesh, P("dp"))

    def put_batch(batch):
        return tuple(
            jax.make_array_from_process_local_data(
                batch_sharding, b[rank * BATCH : (rank + 1) * BATCH]
            )
            for b in batch
        )

    # Resume from the newest step every rank has saved.
    steps_saved = [
        {int(f.stem[4:]) for f in (out / f"rank{r}").glob("step*.npz")} for r in range(n)
    ]
    common = set.intersection(*steps_saved) if all(steps_saved) else set()
    start = max(common, default=0)
    position = 0
    if start:
        saved = np.load(ckpt_dir / f"step{start}.npz")
        leaves = [saved[f"leaf{i}"] for i in range(len(jax.tree.leaves(state)))]
        local = jax.tree.unflatten(jax.tree.structure(state), leaves)
        state = jax.tree.map(
            lambda x, spec: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x),
            local,
            specs,
            is_leaf=is_spec,
        )
        position = int(saved["data_position"])
        resumed = {
            "step": start,
            "count": int(np.asarray(state.opt_state.count)),
            "data_position": position,
        }
        (out / f"resumed{rank}.json").write_text(json.dumps(resumed))

    log = open(out / f"log{rank}.jsonl", "a")  # noqa: SIM115 - closed at exit
    killed_flag = out / "killed"
    t0 = time.monotonic()
    sample_every = max(1, args.steps // 200)
    for t in range(start + 1, args.steps + 1):
        x, y = data(position)
        g_local = None
        if t % sample_every == 0 or t in (start + 1, args.steps):
            # This rank's gradient (the 1-bit residual compresses momenta built from it).
            p0 = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), state.params)
            lo = rank * BATCH
            g_local = jax.grad(loss_fn)(p0, (x[lo : lo + BATCH], y[lo : lo + BATCH]))
        state, loss = step(state, put_batch((x, y)))
        position += 1
        record = {"step": t, "data_position": position, "loss": float(loss)}
        if g_local is not None:
            (bucket,) = state.opt_state.comm.buckets
            e_w = np.asarray(bucket.worker_error.addressable_data(0))
            mu = np.concatenate(
                [
                    np.ravel(compressed_momentum(m, v, args.freeze_step))
                    for m, v in zip(
                        jax.tree.leaves(state.opt_state.mu),
                        jax.tree.leaves(state.opt_state.nu),
                        strict=True,
                    )
                ]
            )
            g = np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(g_local)])
            record.update(
                ef_over_m=float(np.linalg.norm(e_w) / max(np.linalg.norm(mu), 1e-30)),
                ef_over_g=float(np.linalg.norm(e_w) / max(np.linalg.norm(g), 1e-30)),
                rss_mb=_rss_mb(),
                elapsed_s=time.monotonic() - t0,
            )
        log.write(json.dumps(record) + "\n")
        if t % args.ckpt_every == 0:
            local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), state)
            tmp = ckpt_dir / f".tmp{t}.npz"
            np.savez(
                tmp,
                data_position=position,
                **{f"leaf{i}": leaf for i, leaf in enumerate(jax.tree.leaves(local))},
            )
            os.replace(tmp, ckpt_dir / f"step{t}.npz")
            log.flush()
        if rank == 1 and t == args.kill_at and not killed_flag.exists():
            killed_flag.write_text(str(t))
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    return 0


# --------------------------------------------------------------------------------------------
# Driver.


def _launch(args, out: Path, kill_at: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "jaxcomm", "launch", "-n", "2", "--kill-grace", "2",
        "--heartbeat-timeout", "30", "--timeout", str(args.timeout),
        *(["--rate", args.rate] if args.rate else []),
        __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
        "--ckpt-every", str(args.ckpt_every), "--kill-at", str(kill_at),
        "--freeze-step", str(args.freeze_step),
    ]  # fmt: skip
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def _records(out: Path, rank: int) -> list[dict]:
    path = out / f"log{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drive(args) -> dict:
    from jaxcomm.cli.netshape import network_shaping_problem

    if args.rate and network_shaping_problem(args.rate):
        print(f"soak: unshaped loopback ({network_shaping_problem(args.rate)})", file=sys.stderr)
        args.rate = None
    base = Path(tempfile.mkdtemp(prefix="jaxcomm-soak-", dir=args.workdir))
    out = base / "run"
    t0 = time.monotonic()
    first = _launch(args, out, args.kill_at)
    t_first = time.monotonic() - t0
    killed = (out / "killed").exists()
    if first.returncode == 0 or not killed:
        raise SystemExit(f"soak: the first launch should have been killed:\n{first.stderr[-3000:]}")
    before = {r: _records(out, r) for r in range(2)}
    second = _launch(args, out, args.kill_at)
    elapsed = time.monotonic() - t0
    if second.returncode != 0:
        raise SystemExit(f"soak: the restarted run failed:\n{second.stderr[-3000:]}")
    resumed = [json.loads((out / f"resumed{r}.json").read_text()) for r in range(2)]
    ckpt = (args.kill_at // args.ckpt_every) * args.ckpt_every
    result = {
        "steps": args.steps,
        "ckpt_every": args.ckpt_every,
        "kill_at": args.kill_at,
        "rate": args.rate or "unshaped",
        "first_launch": {"returncode": first.returncode, "seconds": round(t_first, 1),
                         "launcher": first.stderr.strip().splitlines()[-1]},
        "resumed": resumed,
        "expected_resume_step": ckpt,
        "seconds": round(elapsed, 1),
    }  # fmt: skip
    problems = []
    for r in range(2):
        rec = _records(out, r)
        steps = [x["step"] for x in rec]
        # Attempt 1 wrote 1..(kill) (rank 0 maybe a few steps further), attempt 2 ckpt+1..end.
        restart = len(before[r])
        second_steps = steps[restart:]
        if resumed[r] != {"step": ckpt, "count": ckpt, "data_position": ckpt}:
            problems.append(f"rank {r} resumed at {resumed[r]}, expected step {ckpt}")
        if second_steps != list(range(ckpt + 1, args.steps + 1)):
            problems.append(f"rank {r}: steps after the restart are not {ckpt + 1}..{args.steps}")
        if any(x["data_position"] != x["step"] for x in rec):
            problems.append(f"rank {r}: a data position differs from its step")
        final = {x["step"]: x for x in before[r] if x["step"] <= ckpt}
        final.update({x["step"]: x for x in rec[restart:]})
        if sorted(final) != list(range(1, args.steps + 1)):
            problems.append(f"rank {r}: the merged run does not cover 1..{args.steps}")
        samples = [final[s] for s in sorted(final) if "rss_mb" in final[s]]
        half, every = len(samples) // 2, max(1, len(samples) // 10)
        result[f"rank{r}"] = {
            "rss_mb": {
                "start": round(samples[0]["rss_mb"], 1),
                "middle": round(samples[half]["rss_mb"], 1),
                "end": round(samples[-1]["rss_mb"], 1),
            },
            "ef_over_m": [(x["step"], round(x["ef_over_m"], 3)) for x in samples[::every]],
            "ef_over_g": [(x["step"], round(x["ef_over_g"], 3)) for x in samples[::every]],
            "ef_over_m_max_first_half": round(max(x["ef_over_m"] for x in samples[:half]), 3),
            "ef_over_m_max_second_half": round(max(x["ef_over_m"] for x in samples[half:]), 3),
            "loss_first_last": [round(final[1]["loss"], 4), round(final[args.steps]["loss"], 4)],
        }
        result.setdefault("_losses", {})[r] = [final[s]["loss"] for s in sorted(final)]
    steady = [x["elapsed_s"] for x in _records(out, 0)[len(before[0]) :] if "elapsed_s" in x]
    if len(steady) > 1:
        span = (args.steps - ckpt - 1) or 1
        result["ms_per_step_after_restart"] = round(1000 * steady[-1] / span, 2)
    if args.reference:
        ref = base / "reference"
        third = _launch(args, ref, kill_at=-1)
        if third.returncode != 0:
            raise SystemExit(f"soak: the reference run failed:\n{third.stderr[-3000:]}")
        ref_losses = [x["loss"] for x in _records(ref, 0)]
        same = ref_losses == result["_losses"][0]
        result["reference_losses_equal"] = same
        if not same:
            problems.append("the resumed run's losses differ from the uninterrupted run's")
    result.pop("_losses")
    result["problems"] = problems
    if problems or args.keep:
        result["out_dir"] = str(base)  # checkpoints and step logs, to look at
    else:
        shutil.rmtree(base, ignore_errors=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--ckpt-every", type=int, default=1000)
    p.add_argument("--kill-at", type=int, default=None, help="default: a bit past the middle")
    p.add_argument("--freeze-step", type=int, default=None, help="default: steps // 20")
    p.add_argument("--rate", default="1gbit", help="tc rate of the loopback ('' for unshaped)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--reference", action="store_true", help="also run uninterrupted, compare")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.add_argument("--workdir", default=None, help="where the run directory goes (a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep checkpoints and logs after success")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.freeze_step is None:
        args.freeze_step = max(2, args.steps // 20)
    if args.kill_at is None:
        args.kill_at = args.steps // 2 + args.ckpt_every // 2
    if args.worker:
        return worker(args)
    if not 0 < args.ckpt_every <= args.kill_at < args.steps:
        p.error("need 0 < --ckpt-every <= --kill-at < --steps")
    result = drive(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
