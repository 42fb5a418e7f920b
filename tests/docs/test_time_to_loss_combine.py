"""``time_to_loss.py --combine``: repeated runs become one result of per-method medians, and the
README's tables show the median with its range."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_tables  # noqa: E402
import time_to_loss  # noqa: E402


def _run(budget, demo_s, date, target=2.5):
    """One run's summary: exact Adam takes ``budget`` seconds, DeMo ``demo_s`` (None: not
    reached)."""

    def row(t, steps):
        return {
            "steps": steps,
            "seconds_to_adam_loss": t,
            "speedup_to_adam_loss": budget / t if t else None,
            "step_ms": 10.0 * steps,
            "loss_within_adam_time": 2.4,
            "bytes_per_process": 1e6,
        }

    return {
        "rate": "100mbit",
        "size": "large",
        "params": 1000,
        "exact_adam_steps": 100,
        "settings": {"lr": 1e-3},
        "target_loss": target,
        "budget_s": budget,
        "date": date,
        "command": "time_to_loss.py --rate 100mbit --size large --json x.json",
        "rows": {"exact_adam": row(budget, 100), "demo": row(demo_s, 80)},
        "curves": {"exact_adam": {"seconds": [0.0, budget], "loss": [3.0, target]}},
    }


def _write(tmp_path, runs):
    files = []
    for i, run in enumerate(runs):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps(run))
    return [str(f) for f in files]


def test_combine_takes_each_methods_median_and_range(tmp_path):
    # DeMo's speedups 60/6 = 10, 50/10 = 5, and not reached (the slowest): median 5.
    runs = [_run(60.0, 6.0, "a"), _run(50.0, 10.0, "b"), _run(55.0, None, "c")]
    out = tmp_path / "combined.json"
    time_to_loss._combine(str(out), _write(tmp_path, runs))
    doc = json.loads(out.read_text())
    demo = doc["rows"]["demo"]
    assert demo["speedup_to_adam_loss"] == pytest.approx(5.0)
    assert (demo["speedup_min"], demo["speedup_max"]) == (0.0, pytest.approx(10.0))
    assert demo["runs_reached"] == 2
    assert demo["seconds_to_adam_loss"] == pytest.approx(10.0)  # median of 6, 10, never
    assert doc["budget_s"] == pytest.approx(55.0) and doc["curves_of"] == "c"
    assert doc["repeats"] == 3 and [r["date"] for r in doc["runs"]] == ["a", "b", "c"]
    text = render_tables.time_to_loss_table({"combined.json": doc})
    assert "| `jc.demo` | 5.00x (not reached-10.00) |" in text.splitlines()
    assert "the median of 3 runs" in text


def test_combine_refuses_runs_of_different_targets(tmp_path):
    runs = [_run(60.0, 6.0, "a"), _run(50.0, 10.0, "b", target=2.6)]
    with pytest.raises(SystemExit, match="target_loss"):
        time_to_loss._combine(str(tmp_path / "out.json"), _write(tmp_path, runs))
