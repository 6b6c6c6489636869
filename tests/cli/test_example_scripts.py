"""examples/scaling/run_debug_sweep.sh: valid bash; by default it writes into a fresh output directory and leaves
the committed example outputs beside it alone; --update-example writes the fit there.

The script's K3 variable names the k3 executable; here it names a recorder that logs each call and writes the
files `k3 sweep` and `k3 scaling-fit` would, so the script's paths are checked in a second, not a 6-minute sweep."""

import shutil
import subprocess
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scaling"
SCRIPT = EXAMPLE / "run_debug_sweep.sh"

RECORDER = """#!/usr/bin/env bash
# logs its arguments; writes what the real command writes under --out
echo "$*" >> "$K3_LOG"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out="$a"; prev="$a"; done
mkdir -p "$out"
case "$1" in
  sweep) echo "N,D,loss,C" > "$out/runs.csv" ;;
  scaling-fit) echo "{}" > "$out/fit.json" ;;
esac
"""


def _run(script, tmp_path, *args, **env):
    recorder = tmp_path / "k3-recorder"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    log = tmp_path / "k3.log"
    log.unlink(missing_ok=True)
    res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "K3": str(recorder), "K3_LOG": str(log), **env}, check=False)
    return res, log.read_text().splitlines() if log.exists() else []


def _committed():
    return {f: (EXAMPLE / f).read_bytes() for f in ("runs.csv", "fit.json", "fit.png")}


def test_script_is_valid_bash():
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_default_run_writes_a_fresh_directory_not_the_committed_outputs(tmp_path):
    before = _committed()
    res, calls = _run(SCRIPT, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0] == "sweep: runs/scaling-debug; fit: runs/scaling-debug/fit"
    assert calls[0].startswith("sweep --preset debug ") and calls[0].endswith(" --out runs/scaling-debug")
    assert calls[1].startswith("scaling-fit runs/scaling-debug/fit/runs.csv --out runs/scaling-debug/fit ")
    assert sorted(p.name for p in (tmp_path / "runs" / "scaling-debug" / "fit").iterdir()) == ["fit.json", "runs.csv"]
    assert _committed() == before


def test_update_example_writes_beside_the_script_and_bad_arguments_are_refused(tmp_path):
    copy = tmp_path / "scaling" / SCRIPT.name  # a copy, so that "beside the script" is not the repository
    copy.parent.mkdir()
    shutil.copy(SCRIPT, copy)
    res, calls = _run(copy, tmp_path, "--update-example")
    assert res.returncode == 0, res.stdout + res.stderr
    assert calls[1].startswith(f"scaling-fit {copy.parent}/runs.csv --out {copy.parent} ")
    assert sorted(p.name for p in copy.parent.iterdir()) == ["fit.json", "run_debug_sweep.sh", "runs.csv"]
    for args in (["--update"], ["--update-example", "extra"]):
        res, calls = _run(copy, tmp_path, *args)
        assert res.returncode == 2 and res.stderr.startswith("usage: ") and calls == [], res.stderr
