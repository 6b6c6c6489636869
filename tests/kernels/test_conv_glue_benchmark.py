"""benchmarks/kda_glue.py runs end to end on a CPU at k3-debug size (the kernels under Triton's interpreter), prints
its table, and every fused output and gradient there matches its PyTorch twin (no timing is checked)."""

import importlib.util
import runpy
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kda_glue.py"


def test_benchmark_smoke_on_cpu(monkeypatch, capsys, triton_cpu):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU smoke run; on a GPU the benchmark itself is the check")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--device", "cpu", "--seq", "20"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("conv", "gated"))]
    assert len(rows) == 6, rows  # three ops, fwd and fwd+bwd each
    assert all(float(r[-1]) < 1e-5 for r in rows), rows  # rel_rms of fp32 kernels against their twins
