"""Every benchmark script imports and parses its arguments (`--help`) on a CPU machine: the GPU sessions run them
from benchmarks/h200_session.sh with little device time, so a broken import or option must fail here first."""

import os
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def test_there_are_benchmark_scripts():
    assert {"kda.py", "serve.py", "serve_step.py", "mla_decode.py"} <= set(SCRIPTS)


# environment a script may set at import (kda_tune.py selects the Triton backend): restored after each test
ENV = ("K3_KERNELS", "K3_KDA_BWD", "FLA_FLASH_KDA", "TRITON_INTERPRET")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_help(name, monkeypatch, capsys):
    for key in ENV:  # setenv records the current value or its absence, which teardown puts back (delenv of an
        # absent key records nothing: kda_grad_error.py's TRITON_INTERPRET then leaked into kda_ptxas.py's test)
        present = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not present:
            monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "argv", [str(BENCH / name), "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCH / name), run_name="__main__")
    assert e.value.code == 0, capsys.readouterr().err
    assert "usage:" in capsys.readouterr().out
