"""CI version of benchmarks/long_run.py: 1,000 steps of 1-bit and int8 error feedback on a
drifting gradient stream stay bounded, and the running average of outputs tracks the inputs'."""

import sys
from pathlib import Path

import numpy as np
import pytest

import jaxcomm as jc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from long_run import run  # noqa: E402


@pytest.mark.parametrize(
    "comp", [jc.OneBit(), jc.Quantize(bits=8, error_feedback=True)], ids=["onebit", "int8-ef"]
)
def test_error_feedback_stays_bounded_over_a_long_run(comp):
    steps = 1000
    final, (worker, server, avg) = run(comp, steps=steps, dim=256, n=8)
    for m in (worker, server, avg):
        assert m.shape == (steps,) and np.isfinite(m).all()
    assert not np.asarray(final.nonfinite).any()
    # Bounded: the residuals of the second half are no larger than those of the first.
    assert worker[steps // 2 :].max() <= 1.5 * worker[: steps // 2].max()
    assert server[steps // 2 :].max() <= 1.5 * server[: steps // 2].max()
    # The pending residual is spread over more and more steps: the running averages converge.
    assert avg[-1] < 0.3 * avg[99] and avg[-1] < 0.02, (avg[99], avg[-1])
