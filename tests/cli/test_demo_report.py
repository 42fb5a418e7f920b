"""The demo's report on synthetic runs: narrow tables, divergence in words, strict JSON, plot."""

import json
import math

import numpy as np
import pytest

from jaxcomm.cli import demo_methods, demo_readme, demo_report
from jaxcomm.cli.demo_methods import EXACT, LOCAL, ONEBIT, SHARDED_INT8

STEPS, WARM = 60, 20
PER_KIND = {EXACT: 2.0e6, ONEBIT: 6.0e4, LOCAL: 0.0, SHARDED_INT8: 5.0e5}


def run(method, losses, kinds, eval_every=20):
    r = demo_methods.RunResult(method, losses=list(losses), kinds=list(kinds))
    r.eval_steps = list(range(eval_every, len(losses) + 1, eval_every))
    r.eval_losses = [float(np.mean(losses[s - 5 : s])) for s in r.eval_steps]
    r.final_eval_loss = r.eval_losses[-1]
    r.final_accuracy = 0.0 if not math.isfinite(r.final_eval_loss) else 0.5
    r.seconds = 1.0
    return r


@pytest.fixture
def runs():
    good = 4.5 - 2.5 * np.linspace(0, 1, STEPS)
    onebit = [EXACT] * WARM + [ONEBIT] * (STEPS - WARM)
    blown = good.copy()
    blown[29:] = np.nan  # non-finite from step 30, 10 steps after the switch
    huge = good.copy()
    huge[24:] = 6e23  # finite but useless: the held-out loss never comes back
    return [
        run("adam", good, [EXACT] * STEPS),
        run("compressed_mean", good + 0.1, onebit),
        run("onebit_adam", blown, onebit),
        run("zero_one_adam", huge, onebit),
    ]


def rows_of(runs):
    return {r["method"]: r for r in demo_report.summarize(runs, PER_KIND, warmup_steps=WARM)}


def test_divergence_is_found_with_step_and_cause(runs):
    by = {r.method: r for r in runs}
    assert demo_report.find_divergence(by["adam"], WARM) is None
    assert demo_report.find_divergence(by["compressed_mean"], WARM) is None
    d = demo_report.find_divergence(by["onebit_adam"], WARM)
    assert (d.method, d.step) == ("onebit_adam", 30)
    assert "nan" in d.what and "warm-up" in d.cause and "step 20" in d.cause
    d = demo_report.find_divergence(by["zero_one_adam"], WARM)
    # Never non-finite, but it ended worse than it began: dated to where the loss blew up.
    assert d is not None and d.step == 25 and "5 steps after the switch" in d.cause
    # A blow-up during the exact warm-up is blamed on the learning rate, not the compression.
    early = run("onebit_adam", [4.5] * 9 + [math.inf] * (STEPS - 9), [EXACT] * STEPS)
    assert "learning rate" in demo_report.find_divergence(early, WARM).cause


def test_a_skipped_nonfinite_step_that_recovers_is_a_note_not_a_divergence(runs):
    losses = 4.5 - 2.5 * np.linspace(0, 1, STEPS)
    losses[33] = np.nan  # e.g. a non-finite gradient the optimizer skipped
    onebit = [EXACT] * WARM + [ONEBIT] * (STEPS - WARM)
    skipped = run("onebit_adam", losses, onebit)
    skipped.eval_losses = [3.7, 2.9, 2.1]
    skipped.final_eval_loss = 2.1
    assert demo_report.find_divergence(skipped, WARM) is None
    rows = demo_report.summarize([runs[0], skipped], PER_KIND, warmup_steps=WARM)
    assert rows[1]["traffic_ratio"] > 1 and rows[1]["nonfinite_steps"] == [34]
    text = demo_report.format_report(rows, PER_KIND, devices=8, steps=STEPS, warmup_steps=WARM)
    assert "NOTE: onebit_adam had a non-finite training loss at 1 step (first: step 34)" in text
    assert "WARNING" not in text


def test_diverged_runs_claim_no_saving_and_the_baseline_is_named(runs):
    rows = rows_of(runs)
    assert rows["adam"]["baseline"] and rows["adam"]["traffic_ratio"] == pytest.approx(1.0)
    ratio = PER_KIND[EXACT] * STEPS / (PER_KIND[EXACT] * WARM + 40 * PER_KIND["1-bit"])
    assert rows["compressed_mean"]["traffic_ratio"] == pytest.approx(ratio)
    for m in ("onebit_adam", "zero_one_adam"):
        assert rows[m]["diverged"] is not None
        assert rows[m]["traffic_ratio"] is None and rows[m]["loss_vs_adam"] is None


def test_report_fits_100_columns_under_launch_and_says_it_in_words(runs):
    rows = list(rows_of(runs).values())
    text = demo_report.format_report(
        rows, PER_KIND, devices=8, steps=STEPS, warmup_steps=WARM
    )
    lines = text.splitlines()
    assert max(len("[rank 0] " + line) for line in lines) <= 100
    assert all(line.isascii() for line in lines)
    headers = [line for line in lines if line.startswith("method")]
    assert len(headers) == 2
    for h in headers:
        cols = [c for c in h.split("  ") if c.strip()]
        assert len(cols) == len(set(cols)), h  # no two columns with the same heading
    adam = next(line for line in lines if line.startswith("adam "))
    assert "baseline" in adam and "1.0x" not in adam
    onebit = next(line for line in lines if line.startswith("onebit_adam "))
    assert "diverged" in onebit and "less" not in onebit
    prose = " ".join(lines)
    assert "onebit_adam diverged at step 30" in prose and "zero_one_adam diverged" in prose
    assert "warm-up" in prose and "No traffic saving is reported" in prose
    cm = next(line for line in lines if line.startswith("compressed_mean "))
    assert f"{rows[1]['traffic_ratio']:.1f}x less" in cm


def test_json_is_strict(runs):
    rows = list(rows_of(runs).values())
    doc = demo_report.json_safe(dict(rows=rows, runs=[r.__dict__ for r in runs]))
    back = json.loads(json.dumps(doc, allow_nan=False))
    assert back["rows"][2]["eval_loss"] is None and back["rows"][2]["diverged"]["step"] == 30


def test_plot_keeps_the_axis_on_runs_that_trained(runs, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    notes, ylim = demo_report.plot(runs, PER_KIND, str(path), warmup_steps=WARM)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ylim[1] < 10  # not 6e23: the diverged curves do not set the scale
    assert ylim[0] < 2.2
    assert any("onebit_adam diverged at step 30" in n for n in notes)
    assert any("zero_one_adam" in n for n in notes)


def test_demo_command_json_on_stdout_report_on_stderr_files_in_out(tmp_path, capsys):
    pytest.importorskip("flax")
    pytest.importorskip("matplotlib")
    from jaxcomm.cli.main import main

    out = tmp_path / "runs"
    argv = ["demo", "--steps", "4", "--batch", "4", "--warmup-fraction", "0.5"]
    assert main([*argv, "--methods", "adam,onebit_adam", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()

    def no_nan(name):
        raise AssertionError(f"{name} in strict JSON")

    doc = json.loads(captured.out, parse_constant=no_nan)  # stdout is the JSON document only
    assert [r["method"] for r in doc["rows"]] == ["adam", "onebit_adam"]
    assert doc["rows"][0]["baseline"] and doc["rows"][0]["traffic_ratio"] == 1.0
    assert json.loads((out / "demo.json").read_text()) == doc
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out loss" in captured.err and "traffic vs Adam" in captured.err
    # Not a terminal: a plain line per method and at its last step, with that step's loss.
    for run in doc["runs"]:
        assert f"demo {run['method']}: 4 steps\n" in captured.err
        assert f"demo {run['method']}: step 4/4  loss {run['losses'][-1]:.4f}  elapsed" in (
            captured.err
        )


def test_markdown_table_for_the_readme_comes_from_the_json(runs):
    rows = list(rows_of(runs).values())
    doc = json.loads(json.dumps(demo_report.json_safe(dict(rows=rows))))
    lines = demo_readme.markdown_table(doc).splitlines()
    assert len(lines) == 2 + len(rows)
    adam, cm, onebit, _ = lines[2:]
    assert adam.startswith("| Adam, exact `pmean` | 2.0847 |  | 50.0% | 120.0 MB | 1x |")
    assert f"| {100 * rows[1]['loss_vs_adam']:+.1f}% |" in cm
    assert f"| {rows[1]['traffic_ratio']:.1f}x less |" in cm
    assert "| nan | diverged at step 30 |" in onebit and "less" not in onebit
