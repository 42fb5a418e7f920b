"""The ``jaxcomm bench`` command: in-process on the session's 8 devices, and on 2 processes."""

import json
import sys

import pytest

from jaxcomm.cli.main import main
from tests.conftest import NUM_DEVICES
from tests.integration.test_distributed import multiprocess

N = NUM_DEVICES


def test_bench_json_and_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["bench", "--ops", "all_reduce,all_gather", "--sizes", "8K", "--repeats", "1"]
    code = main([*args, "--json", str(out), "--plain"])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {(r["op"], r["compressor"]): r for r in result["rows"]}
    assert set(rows) == {(o, c) for o in ("all_reduce", "all_gather") for c in ("none", "onebit")}
    assert result["config"]["sizes"] == [8192]
    # fp32 ring all-reduce of 2048 floats: 2 * 7/8 * 8192 bytes per device.
    assert rows["all_reduce", "none"]["wire_bytes"] == 2 * 7 / 8 * 8192
    assert rows["all_reduce", "none"]["rel_error"] < 1e-6
    assert (
        rows["all_reduce", "none"]["wire_bytes"] / rows["all_reduce", "onebit"]["wire_bytes"] > 20
    )
    table = capsys.readouterr().out
    assert f"{N} devices in one process" in table
    assert sum(line.startswith("all_reduce") for line in table.splitlines()) == 2


def test_bench_bad_input_is_a_clear_error(capsys, monkeypatch):
    assert main(["bench", "--ops", "gossip"]) == 2
    assert "unknown op" in capsys.readouterr().err
    assert main(["bench", "--compressors", "zip"]) == 2
    assert "unknown compressor 'zip'" in capsys.readouterr().err
    assert main(["bench", "--sizes", "12X"]) == 2
    assert "cannot read size" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "--plot", "out.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


@multiprocess
def test_bench_on_two_processes(tmp_path):
    out = tmp_path / "rows.json"
    args = ["bench", "--procs", "2", "--ops", "all_reduce,reduce_scatter", "--sizes", "4K"]
    assert main([*args, "--repeats", "2", "--json", str(out), "--plain"]) == 0
    rows = {(r["op"], r["compressor"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4 and all(r["devices"] == 2 for r in rows.values())
    # n = 2: an all-reduce sends S, a reduce-scatter S/2 (ring model), in any process.
    assert rows["all_reduce", "none"]["wire_bytes"] == 4096
    assert rows["reduce_scatter", "none"]["wire_bytes"] == 2048
    for op in ("all_reduce", "reduce_scatter"):
        assert rows[op, "none"]["rel_error"] < 1e-6
        assert rows[op, "onebit"]["wire_bytes"] < rows[op, "none"]["wire_bytes"] / 10
        assert 0 < rows[op, "onebit"]["rel_error"] < 1


def test_unknown_command_is_refused():
    with pytest.raises(SystemExit):
        main(["nope"])


def test_version(capsys):
    import jaxcomm

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"jaxcomm {jaxcomm.__version__} (jax ")


@pytest.mark.parametrize("argv", [[], ["bench"], ["launch"], ["demo"]])
def test_help_is_terminal_text(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":mod:", ":class:", "===", "::"):
        assert markup not in text, (argv, markup)
    if argv == ["bench"]:
        # The columns it documents are the ones it prints (format_rows' headings).
        from jaxcomm.cli import bench_report

        heads = bench_report.format_rows([]).split("  ")
        assert "wire GB/s" in heads and "wire GB/s" in text and "wire bw" not in text
        assert "'all' runs every registered compressor that needs no arguments: " in " ".join(
            text.split()
        )


def test_demo_help_lists_methods_and_defaults(capsys):
    from jaxcomm.cli import demo_run

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    d = demo_run.DemoConfig()
    assert "from: " + ", ".join(demo_run.METHODS) in text
    assert f"(default: {', '.join(d.methods)})" in text
    for default in (f"({d.batch_per_device})", f"({d.learning_rate:g})", f"({d.steps})"):
        assert default in text
    assert f"onebit_lamb ({d.lamb_learning_rate:g})" in text


def test_demo_refuses_unknown_methods_before_training(capsys, monkeypatch):
    from jaxcomm.cli import demo_run

    def no_training(*args, **kwargs):
        raise AssertionError("trained before validating --methods")

    monkeypatch.setattr(demo_run, "train", no_training)
    assert main(["demo", "--methods", "adam,onebit_adamm,lion", "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert "unknown methods 'onebit_adamm', 'lion'" in err
    assert "valid methods: " + ", ".join(demo_run.METHODS) in err
    assert main(["demo", "--methods", ",", "--plot", ""]) == 2
    assert "no method given" in capsys.readouterr().err


def test_demo_without_the_examples_extra_says_what_to_install(capsys, monkeypatch):
    from jaxcomm.cli import demo_run

    monkeypatch.setattr(demo_run, "run", lambda *a, **k: pytest.fail("ran without matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["demo", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'jaxcomm[cli]'" in err
    assert "--plot ''" in err  # the way to run without it
    assert "Traceback" not in err and "ModuleNotFoundError" not in err
