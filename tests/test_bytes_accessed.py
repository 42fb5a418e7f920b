"""benchmarks/bytes_accessed.py at tiny sizes: every phase compiled, ratios against the local
step, the targets, and the instruction breakdown's byte counts; benchmarks/hlo_bytes.py's HLO
count against XLA's cost analysis and on hand-counted programs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bytes_accessed  # noqa: E402
import hlo_bytes  # noqa: E402


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
    for r in report["rows"]:  # the HLO count beside the cost analysis
        assert r["hlo_bytes_mirror"] == pytest.approx(r["bytes"], rel=1e-5)
        assert r["hlo_ratio"] == pytest.approx(r["hlo_bytes"] / rows["local", "step"]["hlo_bytes"])


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
def test_every_phase_a_schedule_reaches_has_its_name(name):
    """The rows are labelled by the phase values the schedule really runs, each named once."""
    method = bytes_accessed.methods()[name]
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
    seen = bytes_accessed.phases_of(method, mesh)
    labels = [method.phase_label(values) for values in seen]
    assert sorted(labels) == sorted(method.phase_names.values())
    assert labels[0] == "warm-up" and labels[-1] == "1-bit"  # in the order a run meets them


def test_hlo_count_of_a_fused_elementwise_function_is_its_three_arrays():
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    compiled = jax.jit(lambda a, b: a * 2 + b).lower(x, x).compile()
    text = compiled.as_text()
    assert hlo_bytes.hlo_bytes_accessed(text) == 3 * 4 * 1024  # read a and b, write the sum
    assert hlo_bytes.hlo_bytes_accessed(text, mirror=True) == 3 * 4 * 1024
    assert bytes_accessed.bytes_accessed(compiled) == 3 * 4 * 1024


# A while loop of known trip count (5) over a tuple, and a fusion whose root is an in-place
# dynamic-update-slice of a 4096-element buffer by 64 elements.
HAND_WRITTEN = """HloModule hand, is_scheduled=true

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[256]{0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  %y = f32[256]{0} sine(%x)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i2, %y)
}

%cond (q: (s32[], f32[256])) -> pred[] {
  %q = (s32[], f32[256]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%fused_dus (a: f32[4096], b: f32[64], c: s32[]) -> f32[4096] {
  %a = f32[4096]{0} parameter(0)
  %b = f32[64]{0} parameter(1)
  %c = s32[] parameter(2)
  %m = f32[64]{0} multiply(%b, %b)
  ROOT %d = f32[4096]{0} dynamic-update-slice(%a, %m, %c)
}

ENTRY %main (x: f32[256], buf: f32[4096], u: f32[64], k: s32[]) -> (f32[256], f32[4096]) {
  %x = f32[256]{0} parameter(0)
  %buf = f32[4096]{0} parameter(1)
  %u = f32[64]{0} parameter(2)
  %k = s32[] parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %x)
  %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, TRIPS
  %r = f32[256]{0} get-tuple-element(%w), index=1
  %f = f32[4096]{0} fusion(%buf, %u, %k), kind=kLoop, calls=%fused_dus
  ROOT %out = (f32[256]{0}, f32[4096]{0}) tuple(%r, %f)
}
""".replace("TRIPS", 'backend_config={"known_trip_count":{"n":"5"}}')


def test_hlo_count_of_a_hand_written_module():
    body = (4 + 4 + 4) + (1024 + 1024)  # add of two s32 scalars, sine of 256 floats
    cond = 4 + 4 + 1  # compare: two s32 read, a pred written
    dus = 256 + 256 + 4  # the update written in place, b read, the index read; not the buffer
    assert hlo_bytes.hlo_bytes_accessed(HAND_WRITTEN) == 5 * body + 6 * cond + dus
    # XLA's cost analysis: one trip, and each tuple its 8-byte pointer table
    mirror = 16 + (body + 16) + cond + dus + 16
    assert hlo_bytes.hlo_bytes_accessed(HAND_WRITTEN, mirror=True) == mirror
    top = hlo_bytes.breakdown(HAND_WRITTEN, 5)
    assert [(r["op"], r["bytes"]) for r in top] == [("while", 5 * body + 6 * cond),
                                                    ("fusion:kLoop", dus)]  # fmt: skip


def test_hlo_count_against_cost_analysis(tmp_path):
    """On CPU programs (the local step and two optimizers' steps over 2 devices, no loops):
    the HLO count of what XLA charges equals compiled.cost_analysis() but for XLA summing in
    float32 (1e-5), and the measure differs from it only by tuple pointer tables (8 bytes an
    element: under 1% at these sizes)."""
    out = tmp_path / "bytes.json"
    argv = ["--layers", "2", "--width", "64", "--batch", "8", "--devices", "2",
            "--methods", "exact,int8_ef", "--json", str(out)]  # fmt: skip
    assert bytes_accessed.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["local", "exact", "int8_ef"]
    for r in rows:
        assert r["cost_analysis"] == r["bytes"]
        assert r["hlo_bytes_mirror"] == pytest.approx(r["bytes"], rel=1e-5)
        assert r["hlo_bytes"] == pytest.approx(r["bytes"], rel=1e-2)
        assert r["hlo_ratio"] == pytest.approx(r["hlo_bytes"] / rows[0]["hlo_bytes"])


# Async collectives as XLA:GPU schedules them: each start returns (operands, output buffer),
# each done the output.
ASYNC_COLLECTIVES = """HloModule pairs, is_scheduled=true

ENTRY %main (x: s8[8,256], y: f32[1,64]) -> (s8[8,256], f32[8,64]) {
  %x = s8[8,256]{1,0} parameter(0)
  %y = f32[1,64]{1,0} parameter(1)
  %a2a-start = ((s8[8,256]{1,0}), s8[8,256]{1,0}) all-to-all-start(%x), dimensions={0}
  %a2a-done = s8[8,256]{1,0} all-to-all-done(%a2a-start)
  %ag-start = (f32[1,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%y), dimensions={0}
  %ag-done = f32[8,64]{1,0} all-gather-done(%ag-start)
  ROOT %out = (s8[8,256]{1,0}, f32[8,64]{1,0}) tuple(%a2a-done, %ag-done)
}
"""


def test_hlo_count_of_an_async_collective_pair_is_its_operand_and_output():
    all_to_all = 8 * 256 + 8 * 256  # the codes sent, the codes received
    all_gather = 4 * 64 + 4 * 8 * 64  # this device's block, the gathered blocks
    assert hlo_bytes.hlo_bytes_accessed(ASYNC_COLLECTIVES) == all_to_all + all_gather
