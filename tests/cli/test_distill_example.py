"""examples/distill/run.sh: valid bash, and without its base checkpoint it stops at once with the fix (exit 2)."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "distill" / "run.sh"


def test_script_parses_and_names_the_missing_base(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "BASE": str(tmp_path / "none"), "OUT": str(tmp_path / "o")},
                         check=False)
    assert res.returncode == 2 and "k3 pretrain --out runs/tiny" in res.stderr
    assert not (tmp_path / "o").exists()
