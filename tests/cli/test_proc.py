"""jaxcomm.cli._proc.helper_process: the one way the launcher and the relay start helpers."""

import subprocess
import sys
import time

import pytest

from jaxcomm.cli._proc import helper_process


def _python(code):
    return [sys.executable, "-c", code]


def test_ready_helper_is_yielded_and_stopped_at_exit():
    code = "import time; print('ready 7', flush=True); time.sleep(60)"
    with helper_process(
        _python(code), ready=lambda line: line.startswith("ready"), error=RuntimeError,
        startup_timeout=30,
    ) as (proc, line):  # fmt: skip
        assert line == "ready 7" and proc.poll() is None
    assert proc.poll() is not None  # its process group was stopped


@pytest.mark.parametrize("code", ["import sys; sys.stderr.write('why\\n'); print('nope')",
                                  "import time; time.sleep(60)"])  # fmt: skip
def test_helper_that_is_not_ready_is_stopped_and_its_stderr_raised(code):
    started = time.monotonic()

    def error(stderr):
        return RuntimeError(f"helper failed: {stderr}")

    with pytest.raises(RuntimeError, match="helper failed") as info:
        with helper_process(
            _python(code), ready=lambda line: line == "ready", error=error, startup_timeout=2,
            capture_stderr=True,
        ):  # fmt: skip
            pytest.fail("yielded a helper that never said it was ready")
    assert time.monotonic() - started < 20  # bounded by startup_timeout + grace
    if "nope" in code:
        assert "why" in str(info.value)


def test_no_helper_is_left_behind():
    """A failed start leaves no process of the helper's session running."""
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    with pytest.raises(RuntimeError):
        with helper_process(
            _python(code), ready=lambda line: False, error=lambda _: RuntimeError("no"),
            startup_timeout=10,
        ):  # fmt: skip
            pass
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert code not in out
