"""The repository passes `ruff check` with the settings of pyproject.toml (ruff comes with the `dev` extra)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    res = subprocess.run([str(ruff), "check", "--output-format", "concise", str(ROOT)], capture_output=True, text=True,
                         timeout=120, check=False, cwd=ROOT)
    assert res.returncode == 0, f"ruff check found problems (fix them or `ruff check --fix`):\n{res.stdout}{res.stderr}"
