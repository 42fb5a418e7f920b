"""The demo's accounting and training, on a tiny configuration."""

import re

import numpy as np
import pytest

pytest.importorskip("rich")

import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jaxcomm.cli import demo_methods, demo_report, demo_run  # noqa: E402
from jaxcomm.cli.demo_methods import DILOCO_INT4, EXACT, LOCAL, ONEBIT  # noqa: E402
from jaxcomm.cli.models import ByteBatches  # noqa: E402


def zero_one_schedule(steps, freeze, var_scaler, local_scaler, clipper):
    """Kinds of 0/1 Adam's steps from DeepSpeed's interval rules (independent of jaxcomm)."""
    kinds, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for t in range(1, steps + 1):
        if t <= freeze:
            if t % var_interval == 0:
                kinds.append(EXACT)
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            else:
                kinds.append(ONEBIT)
        else:
            kinds.append(ONEBIT if t % local_interval == 0 else LOCAL)
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return kinds


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    cfg = demo_methods.DemoConfig(
        steps=24,
        batch_per_device=4,
        width=32,
        layers=1,
        warmup_fraction=0.5,
        var_update_scaler=8,
        local_step_scaler=2,
        local_step_clipper=4,
        diloco_sync_every=10,
        eval_every=20,
        held_out=64,
        methods=("adam", "onebit_adam", "zero_one_adam", "diloco_int4"),
    )
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    data = ByteBatches.from_corpus(context=cfg.context)
    results = [demo_run.train(m, cfg, mesh, data) for m in cfg.methods]
    params = demo_methods.make_model(cfg).init(cfg.seed)
    per_kind = demo_methods.wire_bytes_per_kind(mesh, "dp", params, cfg.bucket_bytes, cfg.methods)
    numel = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    return cfg, results, per_kind, numel


def test_wire_bytes_per_kind_follow_the_ring_model(tiny_run):
    _, _, per_kind, numel = tiny_run
    assert per_kind[EXACT] == pytest.approx(2 * 7 / 8 * 4 * numel, rel=1e-6)
    assert per_kind[EXACT] / per_kind[ONEBIT] > 25
    # int4 codes (+ fp32 scales): a little under 8x less than fp32.
    assert 6 < per_kind[EXACT] / per_kind[DILOCO_INT4] < 8
    assert per_kind[LOCAL] == 0


def test_step_kinds_follow_each_optimizer_schedule(tiny_run):
    cfg, results, _, _ = tiny_run
    runs = {r.method: r for r in results}
    warm = cfg.warmup_steps
    assert runs["adam"].kinds == [EXACT] * cfg.steps
    assert runs["onebit_adam"].kinds == [EXACT] * warm + [ONEBIT] * (cfg.steps - warm)
    expected = zero_one_schedule(cfg.steps, warm, 8, 2, 4)
    assert runs["zero_one_adam"].kinds == expected
    assert LOCAL in expected  # the tiny schedule reaches local steps
    syncs = [DILOCO_INT4 if t % 10 == 0 else LOCAL for t in range(1, cfg.steps + 1)]
    assert runs["diloco_int4"].kinds == syncs


def runs_final_kinds(results, method):
    return next(r.final_kinds for r in results if r.method == method)


def test_diloco_is_evaluated_on_its_outer_parameters():
    """DiLoCo's model is jc.diloco_params (theta), not the local copies that drift after a
    sync; 0/1 Adam's (per device, no theta) is the devices' average."""
    import jaxcomm as jc

    cfg = demo_methods.DemoConfig(
        steps=6, batch_per_device=2, width=32, layers=1, diloco_sync_every=4
    )
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    data = ByteBatches.from_corpus(context=cfg.context)
    model = demo_methods.make_model(cfg)
    tx, _ = demo_methods.optimizer_for("diloco_int4", cfg, "dp")
    # One program for DiLoCo's inner and sync steps (the state is the same; the phase-specialised
    # programs the demo runs are the tiny run's): a compile instead of three.
    step, state = jc.make_train_step(
        mesh, "dp", model.loss, tx, model.init(cfg.seed), specialize_phases=False
    )
    rng = np.random.default_rng(0)
    for _ in range(cfg.steps):  # a sync after step 4, then 2 local steps
        state, _ = step(state, data.sample(rng, (8 * cfg.batch_per_device,)))
    theta = jc.diloco_params(state.opt_state)
    got = demo_run.evaluated_params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(theta), strict=True):
        np.testing.assert_array_equal(a, b)
    mean = jax.tree.map(lambda p: np.mean(np.asarray(p), 0), state.params)
    gap = max(float(np.max(np.abs(a - b))) for a, b in
              zip(jax.tree.leaves(mean), jax.tree.leaves(theta), strict=True))  # fmt: skip
    assert gap > 1e-5  # the local copies have moved on: the check can tell them apart
    zero_one = demo_methods.optimizer_for("zero_one_adam", cfg, "dp")[0]
    per_device = jc.TrainState(state.params, zero_one.init(model.init(cfg.seed)))
    for a, b in zip(jax.tree.leaves(demo_run.evaluated_params(per_device)), jax.tree.leaves(mean),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_training_learns_and_the_table_adds_up(tiny_run, tmp_path):
    cfg, results, per_kind, _ = tiny_run
    for r in results:
        assert np.all(np.isfinite(r.losses)), r.method
        # Better than a uniform guess over the 256 byte values.
        assert r.final_eval_loss < np.log(256), r.method
    rows = {row["method"]: row for row in demo_report.summarize(results, per_kind)}
    for r in results:
        kinds = r.kinds + r.final_kinds
        expected = sum(per_kind[k] for k in kinds)
        assert rows[r.method]["total_bytes"] == pytest.approx(expected)
    assert rows["adam"]["traffic_ratio"] == pytest.approx(1.0)
    assert rows["onebit_adam"]["traffic_ratio"] > 1.5
    # DiLoCo: 2 int4 syncs, evaluated on its outer parameters (no final average charged).
    assert runs_final_kinds(results, "diloco_int4") == []
    assert rows["diloco_int4"]["total_bytes"] == pytest.approx(2 * per_kind[DILOCO_INT4])
    assert rows["diloco_int4"]["steps"][DILOCO_INT4] == 2
    assert rows["diloco_int4"]["traffic_ratio"] > 50
    text = demo_report.format_report(
        list(rows.values()), per_kind, devices=8, steps=cfg.steps, warmup_steps=cfg.warmup_steps
    )
    assert "byte-level transformer" in text and "int4 sync" in text
    path = tmp_path / "demo.png"
    demo_report.plot(results, per_kind, str(path), warmup_steps=cfg.warmup_steps)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_under_jax_distributed_matches_one_process(tmp_path):
    """2 processes x 4 devices (gloo) train exactly like 1 process x 8 devices."""
    import json
    import os
    import socket
    import sys
    from pathlib import Path

    from jaxcomm.cli.launch import launch_local

    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:  # pragma: no cover
        pytest.skip(f"cannot bind on 127.0.0.1: {e}")
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "dist.json"
    argv = [sys.executable, "-m", "jaxcomm", "demo", "--distributed", "--steps", "6"]
    # onebit_adam alone (adam's run compiled twice more, 3 processes, for no other path): its
    # 3 warm-up steps are the exact fp32 all-reduce that adam's every step is, its last 3 the
    # 1-bit collectives, across the 2 processes.
    argv += ["--batch", "2", "--warmup-fraction", "0.5", "--methods", "onebit_adam"]
    argv += ["--plot", "", "--json", str(out)]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    result = launch_local(
        2,
        argv,
        env={
            "JAX_NUM_CPU_DEVICES": "4",
            "XLA_FLAGS": " ".join(flags),
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(repo),
        },
        cwd=str(tmp_path),
        timeout=240,
    )
    assert result.ok, result.describe() + "\n" + result.output[-3000:]
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    # stdout is a pipe, not a terminal: plain progress lines from the lead rank only, with the
    # loss of the step they name.
    for method in ("onebit_adam",):
        last = f"{runs[method]['losses'][-1]:.4f}"
        line = rf"\[rank 0\] demo {method}: step 6/6  loss {last}  elapsed \d+s  left ~0s"
        assert re.search(line, result.output), result.output[-3000:]
    assert "[rank 1] demo" not in result.output

    cfg = demo_methods.DemoConfig(
        steps=6, batch_per_device=2, warmup_fraction=0.5, methods=("onebit_adam",)
    )
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    data = ByteBatches.from_corpus(context=cfg.context)
    for method in cfg.methods:
        local = demo_run.train(method, cfg, mesh, data)
        assert runs[method]["kinds"] == local.kinds
        np.testing.assert_allclose(runs[method]["losses"], local.losses, rtol=1e-4)
