"""Every benchmark script, benchmarks/*.py and benchmarks/repro/*.py, imports and parses its arguments (`--help`) on
a CPU machine: the GPU script (benchmarks/gpu.sh) runs them with little device time, so a broken import or option
must fail here first."""

import os
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(str(p.relative_to(BENCH)) for p in [*BENCH.glob("*.py"), *BENCH.glob("repro/*.py")])


def test_there_are_benchmark_scripts():
    assert {"kda.py", "kda_tune.py", "serve.py", "serve_step.py", "mla_decode.py"} <= set(SCRIPTS)
    assert {"repro/kda_split_check.py", "repro/kda_ptxas.py"} <= set(SCRIPTS)


def test_each_repro_script_is_described():
    """benchmarks/repro/README.md names every script there (what it reproduces or checks)."""
    readme = (BENCH / "repro" / "README.md").read_text()
    missing = [s for s in SCRIPTS if s.startswith("repro/") and f"`{Path(s).name}`" not in readme]
    assert not missing, f"not described in benchmarks/repro/README.md: {missing}"


# environment a script may set at import (kda_tune.py selects the Triton backend): restored after each test
ENV = ("K3_KERNELS", "K3_KDA_BWD", "K3_KDA_RECOMPUTE", "K3_KDA_FP32_DOTS", "FLA_FLASH_KDA", "TRITON_INTERPRET")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_help(name, monkeypatch, capsys):
    for key in ENV:  # setenv records the current value or its absence, which teardown puts back (delenv of an
        # absent key records nothing: one script's TRITON_INTERPRET would leak into the next script's test)
        present = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not present:
            monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "argv", [str(BENCH / name), "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCH / name), run_name="__main__")
    assert e.value.code == 0, capsys.readouterr().err
    assert "usage:" in capsys.readouterr().out
