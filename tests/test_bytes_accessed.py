"""benchmarks/bytes_accessed.py at tiny sizes: every phase compiled, ratios against the local
step, the targets, and the instruction breakdown's byte counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bytes_accessed  # noqa: E402


def test_breakdown_counts_reads_and_writes():
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    text = jax.jit(lambda a: a * 2.0 + 1.0).lower(x).compile().as_text()
    top = bytes_accessed.breakdown(text, 3)
    assert top[0]["bytes"] == 2 * 4 * 1024  # one fused pass: read x, write the result


def test_every_phase_against_the_local_step(tmp_path):
    out = tmp_path / "bytes.json"
    argv = ["--layers", "1", "--width", "32", "--batch", "4", "--devices", "2",
            "--methods", "exact,diloco", "--breakdown", "2", "--json", str(out)]  # fmt: skip
    assert bytes_accessed.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["versions"]["jax"] == jax.__version__ and report["command"]
    rows = {(r["method"], r["phase"]): r for r in report["rows"]}
    assert set(rows) == {("local", "step"), ("exact", "step"), ("diloco", "inner"),
                         ("diloco", "sync")}  # fmt: skip
    local = rows["local", "step"]["bytes"]
    assert local > 0
    for r in report["rows"]:
        assert r["ratio"] == pytest.approx(r["bytes"] / local)
        assert "error" not in r
    assert rows["exact", "step"]["target"] == 1.15
    assert rows["diloco", "inner"]["target"] == 1.05 and rows["diloco", "sync"]["target"] == 1.5
    assert rows["diloco", "sync"]["first_step"] == bytes_accessed.methods()["diloco"].cycle - 1
    assert len(rows["exact", "step"]["top_instructions"]) == 2
