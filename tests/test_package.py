"""Package layout: what ``import jaxcomm`` loads, the ``jaxcomm`` command's module entry point."""

import subprocess
import sys


def test_import_jaxcomm_loads_no_tool():
    code = (
        "import sys, jaxcomm\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('jaxcomm.tools'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_python_m_jaxcomm_is_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "jaxcomm", "--help"], capture_output=True, text=True, check=True
    )
    assert "bench" in out.stdout and "launch" in out.stdout and "demo" in out.stdout
