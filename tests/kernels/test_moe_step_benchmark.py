"""benchmarks/moe_step.py's CPU smoke run: every row prints, and the earlier and current formulations of the MoE
dispatch and of the Muon step compute the same results (no timing is checked)."""

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_step.py"


def test_cpu_smoke_run_prints_every_row_with_matching_results(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--device", "cpu", "--iters", "1", "--warmup", "0"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    names = ("moe fwd", "moe fwd+bwd", "muon step")
    rows = {n: line[len(n):].split() for line in out.splitlines() for n in names if line.startswith(n + " ")}
    assert set(rows) == set(names), out
    for cols in rows.values():
        assert cols[-2].endswith("x") and float(cols[-2][:-1]) > 0  # ratio before / now
        # fp32 on the CPU: the two formulations agree to fp32 rounding (outputs, gradients, parameter changes)
        assert float(cols[-1]) < 1e-5, out
