"""benchmarks/linear_ce.py runs end to end on a CPU at k3-debug size, prints its table, and the fused and
checkpointed rows match the whole-logits row; one row's peak-memory probe prints its figure (no timing is checked)."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_ce.py"
SMALL = ["--device", "cpu", "--preset", "debug", "--tokens", "100", "--chunks", "default,33"]


@pytest.fixture(autouse=True)
def _cpu_only():
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke run; on a GPU the benchmark itself is the check")


def test_benchmark_smoke_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *SMALL, "--reps", "1", "--no-peak"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert "preset debug: N=100 D=64 V=512, fp32" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("whole", "checkpointed", "fused"))]
    assert [r[0] for r in rows] == ["whole", "checkpointed", "fused", "fused"], rows
    assert rows[2][2] == "default" and rows[3][1] == "33", rows
    for r in rows:
        assert float(r[-1]) < 1e-5, r  # rel: loss and gradients against the whole-logits row


def test_peak_memory_probe(monkeypatch, capsys):
    """What the table runs in a child process per row on a CPU, here in this process."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *SMALL, "--peak-row", "fused 33"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak_mib"] >= 0
