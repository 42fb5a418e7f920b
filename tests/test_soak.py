"""CI version of benchmarks/soak.py: 2 ranks under ``jaxcomm launch``, 1-bit Adam, checkpoints,
rank 1 killed mid-run and the job restarted: no lost step, and the losses equal an
uninterrupted run's bit for bit (the checkpoint holds the error feedback and data position)."""

import json
import subprocess
import sys
from pathlib import Path

from test_distributed import multiprocess
from test_launch import _env

pytestmark = multiprocess
SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_killed_and_resumed_soak_loses_no_step(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--steps", "60", "--ckpt-every", "20", "--kill-at", "47",
         "--freeze-step", "5", "--rate", "", "--reference", "--json", str(out),
         "--workdir", str(tmp_path)],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    # The first launch really died of the kill, naming rank 1.
    assert result["first_launch"]["returncode"] != 0
    assert "rank 1 exited with code -9" in result["first_launch"]["launcher"]
    # Resumed exactly at the last checkpoint before the kill (step, optimizer count, data).
    assert result["expected_resume_step"] == 40
    assert result["resumed"] == [{"step": 40, "count": 40, "data_position": 40}] * 2
    assert result["reference_losses_equal"] is True
    for r in (0, 1):
        info = result[f"rank{r}"]
        assert all(v > 0 for v in info["rss_mb"].values())
        ratios = [v for _, v in info["ef_over_m"]]
        assert ratios and all(0 <= v < 10 for v in ratios)
        assert info["loss_first_last"][1] < info["loss_first_last"][0]
