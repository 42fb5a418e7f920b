"""The demo's accounting and training, on a tiny configuration."""

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("rich")

import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jaxcomm.tools import demo  # noqa: E402
from jaxcomm.tools.textdata import CharBatches  # noqa: E402


def zero_one_schedule(steps, freeze, var_scaler, local_scaler, clipper):
    """Kinds of 0/1 Adam's steps from DeepSpeed's interval rules (independent of jaxcomm)."""
    kinds, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for t in range(1, steps + 1):
        if t <= freeze:
            if t % var_interval == 0:
                kinds.append(demo.EXACT)
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            else:
                kinds.append(demo.ONEBIT)
        else:
            kinds.append(demo.ONEBIT if t % local_interval == 0 else demo.LOCAL)
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return kinds


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    cfg = demo.DemoConfig(
        steps=40,
        batch_per_device=32,
        hidden=32,
        warmup_fraction=0.5,
        var_update_scaler=8,
        local_step_scaler=2,
        eval_every=20,
        methods=("adam", "onebit_adam", "zero_one_adam"),
    )
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    data = CharBatches.from_corpus(context=cfg.context)
    results = [demo.train(m, cfg, mesh, data) for m in cfg.methods]
    from flax import nnx

    _, params = nnx.split(demo.make_model(cfg, data.vocab_size), nnx.Param)
    per_kind = demo.wire_bytes_per_kind(mesh, "dp", params, cfg.bucket_bytes)
    numel = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    return cfg, results, per_kind, numel


def test_wire_bytes_per_kind_follow_the_ring_model(tiny_run):
    _, _, per_kind, numel = tiny_run
    assert per_kind[demo.EXACT] == pytest.approx(2 * 7 / 8 * 4 * numel, rel=1e-6)
    assert per_kind[demo.EXACT] / per_kind[demo.ONEBIT] > 25
    assert per_kind[demo.LOCAL] == 0


def test_step_kinds_follow_each_optimizer_schedule(tiny_run):
    cfg, results, _, _ = tiny_run
    runs = {r.method: r for r in results}
    warm = cfg.warmup_steps
    assert runs["adam"].kinds == [demo.EXACT] * cfg.steps
    assert runs["onebit_adam"].kinds == [demo.EXACT] * warm + [demo.ONEBIT] * (cfg.steps - warm)
    expected = zero_one_schedule(cfg.steps, warm, 8, 2, 16)
    assert runs["zero_one_adam"].kinds == expected
    assert demo.LOCAL in expected  # the tiny schedule reaches local steps


def test_training_learns_and_the_table_adds_up(tiny_run, tmp_path):
    cfg, results, per_kind, _ = tiny_run
    for r in results:
        assert np.all(np.isfinite(r.losses)), r.method
        # Better than a uniform guess over the vocabulary.
        assert r.final_eval_loss < np.log(CharBatches.from_corpus().vocab_size), r.method
    rows = {row["method"]: row for row in demo.summarize(results, per_kind)}
    for r in results:
        kinds = r.kinds + r.final_kinds
        expected = sum(per_kind[k] for k in kinds)
        assert rows[r.method]["total_bytes"] == pytest.approx(expected)
    assert rows["adam"]["traffic_ratio"] == pytest.approx(1.0)
    assert rows["onebit_adam"]["traffic_ratio"] > 1.5
    path = tmp_path / "demo.png"
    demo.plot(results, per_kind, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_under_jax_distributed_matches_one_process(tmp_path):
    """2 processes x 4 devices (gloo) train exactly like 1 process x 8 devices."""
    import json
    import os
    import socket
    import sys
    from pathlib import Path

    from jaxcomm.tools.launch import launch_local

    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:  # pragma: no cover
        pytest.skip(f"cannot bind on 127.0.0.1: {e}")
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "dist.json"
    argv = [sys.executable, "-m", "jaxcomm", "demo", "--distributed", "--steps", "6"]
    argv += ["--batch", "8", "--warmup-fraction", "0.5", "--methods", "adam,onebit_adam"]
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

    cfg = demo.DemoConfig(
        steps=6, batch_per_device=8, warmup_fraction=0.5, methods=("adam", "onebit_adam")
    )
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    data = CharBatches.from_corpus(context=cfg.context)
    for method in cfg.methods:
        local = demo.train(method, cfg, mesh, data)
        assert runs[method]["kinds"] == local.kinds
        np.testing.assert_allclose(runs[method]["losses"], local.losses, rtol=1e-4)
