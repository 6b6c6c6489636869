"""benchmarks/attnres.py's CPU smoke run (Triton's interpreter): every row and the step's sum print, and the fused
kernels and the list-form twin give the same mixture and gradients (no timing is checked)."""

import importlib
import importlib.util
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
    pytest.skip("the CPU smoke run of a Triton benchmark", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attnres.py"
with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):  # triton.jit reads it per kernel
    ar_triton = importlib.import_module("k3.kernels.attnres.triton")


def test_cpu_smoke_run_prints_every_row_with_matching_results(monkeypatch, capsys):
    monkeypatch.setitem(ar_triton.LAUNCH["bwd"], "tiles", 1)  # 5 tokens: one tile a program
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the script sets it; restored after the test
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--device", "cpu", "--batch", "1", "--seq", "5"])
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["2", "fwd"], ["2", "fwd+bwd"],
                                                                             ["3", "fwd"], ["3", "fwd+bwd"])]
    assert len(rows) == 4, out
    for cols in rows:
        assert cols[5].endswith("x") and float(cols[5][:-1]) > 0  # twin / fused
        assert float(cols[-1]) < 1e-5, out  # fp32: the fused kernels equal the twin to rounding
    assert "one k3-debug step's 8 mixtures (S = 2..3)" in out, out
