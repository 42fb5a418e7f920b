"""CI version of benchmarks/soak.py: 2 ranks under ``jaxcomm launch``, 1-bit Adam, checkpoints,
rank 1 killed mid-run and the job restarted: no lost step, and the losses equal an
uninterrupted run's bit for bit (the checkpoint holds the error feedback and data position)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.cli.test_launch import _env
from tests.integration.test_distributed import multiprocess

pytestmark = multiprocess
SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killed_and_resumed_soak_loses_no_step(tmp_path):
    steps, every, kill = 60, 20, 47
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--steps", str(steps), "--ckpt-every", str(every),
         "--kill-at", str(kill), "--freeze-step", "5", "--rate", "", "--reference", "--keep",
         "--json", str(out), "--workdir", str(tmp_path)],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # The first launch really died of the kill, naming rank 1.
    assert result["first_launch"]["returncode"] != 0
    assert "rank 1 exited with code -9" in result["first_launch"]["launcher"]
    # Checked from the ranks' own step logs and checkpoints, not from the script's verdict.
    base = Path(result["out_dir"])
    ckpt = kill // every * every  # the last checkpoint both ranks wrote before the kill
    reference = _records(base / "reference" / "log0.jsonl")
    assert [r["step"] for r in reference] == list(range(1, steps + 1))
    for rank in (0, 1):
        records = _records(base / "run" / f"log{rank}.jsonl")
        # Attempt 1 wrote steps 1.. (rank 1 up to the kill), attempt 2 ckpt + 1 .. steps.
        second = [i for i, r in enumerate(records) if r["step"] == ckpt + 1][-1]
        first, resumed = records[:second], records[second:]
        # (rank 0 is torn down at some step after the last checkpoint.)
        done = kill if rank == 1 else len(first)
        assert [r["step"] for r in first] == list(range(1, done + 1)) and done >= ckpt
        assert [r["step"] for r in resumed] == list(range(ckpt + 1, steps + 1))
        assert all(r["data_position"] == r["step"] for r in records)
        saved = np.load(base / "run" / f"rank{rank}" / f"step{ckpt}.npz")
        assert int(saved["data_position"]) == ckpt
        assert json.loads((base / "run" / f"resumed{rank}.json").read_text()) == {
            "step": ckpt, "count": ckpt, "data_position": ckpt}  # fmt: skip
        # Same compiled program, same data, restored state: the same losses, bit for bit.
        losses = [r["loss"] for r in first[:ckpt]] + [r["loss"] for r in resumed]
        assert losses == [r["loss"] for r in reference]
        assert losses[-1] < losses[0]
    for r in (0, 1):
        info = result[f"rank{r}"]
        assert all(v > 0 for v in info["rss_mb"].values())
        ratios = [v for _, v in info["ef_over_m"]]
        assert ratios and all(0 <= v < 10 for v in ratios)
