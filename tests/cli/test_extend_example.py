"""examples/extend_context/run.sh: valid bash; a missing parent checkpoint and unknown arguments are refused with
exit 2 before any k3 command runs (K3 names a recorder that logs each call)."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "extend_context" / "run.sh"


def _run(tmp_path, *args, **env):
    log = tmp_path / "k3.log"
    recorder = tmp_path / "k3-recorder"
    recorder.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    recorder.chmod(0o755)
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "K3": str(recorder), **env}, check=False)
    return res, log.read_text().splitlines() if log.exists() else []


def test_script_is_valid_bash():
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_missing_parent_and_bad_arguments_are_refused(tmp_path):
    res, calls = _run(tmp_path, PARENT=str(tmp_path / "none"))
    assert res.returncode == 2 and "k3 pretrain --out runs/tiny" in res.stderr and calls == []
    res, calls = _run(tmp_path, "--frobnicate")
    assert res.returncode == 2 and "usage:" in res.stderr and calls == []
