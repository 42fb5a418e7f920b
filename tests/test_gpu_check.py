"""benchmarks/gpu_check.py at small sizes on CPU devices, so the GPU check cannot rot.

The stages it times are checked against NumPy models of the wire formats, their byte counts
against the arrays they read and write, and its 1-bit Adam step against exact Adam during the
warm-up (the same algorithm there) and against the 1-bit wire-byte count.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402

N = 8 * 2048  # whole int8 blocks and whole sign bytes


@pytest.fixture(scope="module")
def stages():
    return gpu_check.stage_functions()


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).standard_normal(N).astype(np.float32)


def test_onebit_stages_match_numpy(stages, x):
    _, compress, _ = stages["onebit compress"]
    packed, scale, error = (np.asarray(a) for a in compress(jnp.asarray(x)))
    ref_scale = np.linalg.norm(x.astype(np.float64)) / math.sqrt(N)
    np.testing.assert_array_equal(packed, np.packbits(x >= 0))  # most significant bit first
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-6)
    sign = np.where(x >= 0, 1.0, -1.0)
    np.testing.assert_allclose(error, x - ref_scale * sign, rtol=1e-6, atol=1e-6 * ref_scale)
    inputs, decompress, _ = stages["onebit decompress"]
    out = np.asarray(decompress(*inputs(jnp.asarray(x))))
    np.testing.assert_allclose(out, ref_scale * sign, rtol=1e-6)


def test_int8_stages_match_numpy(stages, x):
    _, compress, _ = stages["int8 compress"]
    q, inv = (np.asarray(a) for a in compress(jnp.asarray(x)))
    blocks = x.reshape(-1, 2048)
    scale = 256.0 / (2.0 * np.abs(blocks).max(axis=1))
    ref_q = np.clip(np.round(blocks * scale[:, None].astype(np.float32)), -128, 127)
    # The scaled value may round differently at exact halves in fp32 vs NumPy: off by one, rarely.
    assert np.abs(q.astype(np.int32) - ref_q).max() <= 1
    assert np.mean(q == ref_q) > 0.999
    np.testing.assert_allclose(inv, 1.0 / scale, rtol=1e-6)
    inputs, decompress, _ = stages["int8 decompress"]
    out = np.asarray(decompress(*inputs(jnp.asarray(x))))
    np.testing.assert_allclose(out, (q * inv[:, None]).reshape(-1), rtol=1e-6)
    # Within half a step (1 / scale) of the input; a block's positive absmax (scaled to 128)
    # is clipped to 127, a whole step.
    clipped = (blocks * scale[:, None]).reshape(-1) >= 127.5
    bound = np.where(clipped, 1.0, 0.5) / np.repeat(scale, 2048)
    assert np.all(np.abs(out - x) <= bound + 4 * np.finfo(np.float32).eps * np.abs(x))  # fp32


def test_stage_byte_counts_are_what_the_arrays_hold(stages, x):
    for name, (inputs, fn, moved) in stages.items():
        args = inputs(jnp.asarray(x))
        outs = jax.tree.leaves(fn(*args))
        read = sum(np.asarray(a).nbytes for a in args if np.ndim(a) > 0)
        written = sum(np.asarray(o).nbytes for o in outs if np.ndim(o) > 0)  # scalars: noise
        assert moved(N) == read + written, name


#: Section 4's rows in the smoke run: the baseline, an unphased, a phased and a cyclic optimizer.
TRAIN_METHODS = ["local", "exact", "onebit_adam", "diloco", "onebit_adam_cap_in_program"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    argv = ["--cpu", "--small", "--json", str(out), "--train-models", "mlp",
            "--train-methods", ",".join(TRAIN_METHODS), "--budget-s", "1e9"]  # fmt: skip
    assert gpu_check.main(argv) == 0
    return json.loads(out.read_text())


def test_gpu_check_runs_on_cpu(report):
    r = report
    assert [s["stage"] for s in r["stages"]][0].startswith("copy")
    assert all(s["seconds"] > 0 for s in r["stages"])
    # overlap_gpu.py ran both modes in their own processes.
    assert set(r["overlap"]) == {"overlap", "serial"}
    steps = r["train_step"]
    # Warm-up: 1-bit Adam is exact Adam; 3 steps of lr 1e-3 differ only by fp32 rounding.
    assert steps["warmup_max_abs_diff"] <= gpu_check.FREEZE * 1e-3 * 1e-4
    n, size = steps["devices"], r["sizes"]
    numel = size["width"] ** 2  # each layer is a bucket of its own (larger than bucket_mb)
    ring = 2 * (n - 1) / n
    exact = ring * 4 * numel * size["layers"]
    # Per bucket and stage: signs (numel / 8 bytes) plus n fp32 scales; ring-model bytes.
    onebit = ring * (numel / 8 + 4 * n) * size["layers"]
    assert steps["exact Adam"]["wire_bytes"] == pytest.approx(exact, rel=1e-3)
    # Up to a few scalar flags and counters beside the signs.
    assert onebit <= steps["1-bit Adam"]["wire_bytes"] <= onebit + 64 * n


def test_train_rows(report):
    """Section 4: every row timed against the local step, its program's bytes accessed read,
    no compile inside the timed window, DiLoCo timed over one whole cycle."""
    t = report["train_steps"]
    rows = {row["method"]: row for row in t["rows"]}
    assert [row["method"] for row in t["rows"]] == TRAIN_METHODS
    assert all("error" not in row and "skipped" not in row for row in rows.values()), rows
    assert rows["local"]["ratio"] == 1.0 and rows["local"]["devices"] == t["devices"]
    for row in rows.values():
        assert row["step_ms"] > 0 and row["bytes_accessed"] > 0  # XLA:CPU has a cost analysis
        assert row["bytes_ratio"] == pytest.approx(
            row["bytes_accessed"] / rows["local"]["bytes_accessed"]
        )
        assert row["compiles_in_timed_window"] == 0, row
        assert row["compiles_first_step"] >= 1
        assert row["loss_finite"]
    assert rows["diloco"]["timed_steps"] == 16 and rows["diloco"]["step_is"].startswith("mean")
    assert set(rows["diloco"]["phase_labels"]) == {"inner", "sync"}
    by_phase = rows["diloco"]["bytes_accessed_by_phase"]  # 15 inner steps and one sync
    assert rows["diloco"]["bytes_accessed"] == pytest.approx(
        (15 * by_phase["inner"] + by_phase["sync"]) / 16
    )
    assert "1-bit" in rows["onebit_adam"]["phase_labels"]
    # The same optimizer with its skip cap checked in the program: the same phases.
    variant = rows["onebit_adam_cap_in_program"]
    assert variant["call"].endswith("check_skips_on_host=False")
    assert variant["phase_labels"] == rows["onebit_adam"]["phase_labels"]
    assert rows["exact"]["timed_steps"] == 10 and rows["exact"]["step_is"] == "median"


def test_train_rows_past_the_budget_are_skipped(tmp_path):
    out = tmp_path / "skip.json"
    argv = ["--cpu", "--small", "--sections", "4", "--budget-s", "0", "--json", str(out)]
    assert gpu_check.main(argv) == 0
    rows = json.loads(out.read_text())["train_steps"]["rows"]
    assert len(rows) == 2 * len(gpu_check.TRAIN_ORDER)
    assert all(row["skipped"].startswith("budget") for row in rows)


def test_compiled_stage_bytes_are_at_least_what_each_stage_must_move():
    """Each stage's compiled program moves at least the bytes it must read and write (the
    minimum section 1's bandwidths are computed from), and the copy exactly those."""
    rows = gpu_check.compiled_stage_bytes(jax.devices()[0], N)
    assert set(rows) == set(gpu_check.stage_functions())
    assert rows["copy (x + 1)"]["over_minimum"] == 1.0
    for name, r in rows.items():
        assert r["over_minimum"] >= 1.0, name
