"""Bad input to the tools is one clear line and exit 2, before any work (#15.5).

The launcher's cases (busy port, shaping without root, -n 0, no init_distributed) are in
tests/integration/test_hangs.py and tests/cli/test_launch.py; these are the output paths of
bench and demo."""

import os
import sys

import pytest

from jaxcomm.cli._paths import output_problem
from jaxcomm.cli.main import main


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    return path


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_output_problem_cases(tmp_path, a_file):
    assert output_problem(None) is None and output_problem("-") is None
    assert output_problem(tmp_path / "new" / "deeper", directory=True) is None  # creatable
    assert not (tmp_path / "new").exists()  # the check leaves nothing behind
    assert output_problem(tmp_path / "out.json") is None
    assert "is not a directory" in output_problem(a_file / "x.json")
    assert "exists and is not a directory" in output_problem(a_file, directory=True)
    assert "is a directory, expected a file name" in output_problem(tmp_path)
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_unwritable_directory_is_refused():
    assert "cannot write to '/proc'" in output_problem("/proc/out.json")


def test_bench_refuses_bad_outputs_before_measuring(capsys, a_file):
    code, err = _run(capsys, "bench", "--json", str(a_file / "rows.json"))
    assert code == 2 and err.startswith("jaxcomm bench: --json: cannot create"), err
    code, err = _run(capsys, "bench", "--plot", str(a_file / "p.png"))
    assert code == 2 and "jaxcomm bench: --plot:" in err and "is not a directory" in err
    code, err = _run(capsys, "bench", "--procs", "0")
    assert code == 2 and "--procs must be >= 1, got 0" in err
    code, err = _run(capsys, "bench", "--devices", "0")
    assert code == 2 and "--devices must be >= 2, got 0" in err


def test_demo_refuses_bad_outputs_before_training(capsys, a_file):
    code, err = _run(capsys, "demo", "--out", str(a_file))
    assert code == 2 and "jaxcomm demo: --out:" in err and "exists and is not a directory" in err
    code, err = _run(capsys, "demo", "--out", str(a_file.parent / "runs"), "--json",
                     str(a_file / "d.json"))  # fmt: skip
    assert code == 2 and "jaxcomm demo: --json:" in err


@pytest.mark.parametrize(
    "flag, value, want",
    [("--steps", "0", ">= 1"), ("--devices", "0", ">= 1"), ("--batch", "0", ">= 1"),
     ("--lr", "0", "> 0"), ("--warmup-fraction", "1.5", "in [0, 1]")],
)  # fmt: skip
def test_demo_refuses_bad_numbers_before_training(capsys, tmp_path, flag, value, want):
    code, err = _run(capsys, "demo", "--out", str(tmp_path / "runs"), flag, value)
    assert code == 2 and f"jaxcomm demo: {flag} must be {want}, got" in err, err
    assert not (tmp_path / "runs").exists()
