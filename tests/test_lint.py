"""The code base stays ``ruff`` clean (configuration in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    exe = Path(sys.executable).with_name("ruff")  # the test environment's own ruff first
    exe = str(exe) if exe.exists() else shutil.which("ruff")
    assert exe is not None, "ruff is missing: it is a test dependency (pip install -e '.[test]')"
    out = subprocess.run([exe, "check", "--no-cache", "src", "tests"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
