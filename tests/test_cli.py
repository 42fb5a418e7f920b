"""The ``jaxcomm bench`` command, run in-process on the test session's 8 devices."""

import json

from jaxcomm.cli import main


def test_bench_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(
        ["bench", "--sizes", "2048", "--repeats", "1", "--feedback-steps", "3", "--json", str(out)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["compressor"]: r for r in result["rows"]}
    assert result["devices"] == 8
    assert rows["none"]["rel_error"] < 1e-6
    # fp32 ring all-reduce of 2048 floats: 2 * 7/8 * 8192 bytes per device.
    assert rows["none"]["wire_bytes"] == 2 * 7 / 8 * 8192
    assert rows["onebit"]["wire_ratio"] > 25
    # Error feedback: the average over steps is closer to the exact mean than one step.
    assert rows["onebit"]["rel_error_avg"] < rows["onebit"]["rel_error"]
    assert "onebit" in capsys.readouterr().out
