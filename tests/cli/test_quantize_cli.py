"""`k3 quantize` from the command line: every error is one line and exit 2 with nothing written, the flags reach
the quantize section, and `k3 generate` loads the quantized release it writes."""

import json

import pytest
from typer.testing import CliRunner

from k3.cli.main import app


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, pretrain_cmd):
    import subprocess

    out = tmp_path_factory.mktemp("src") / "run"
    subprocess.run(pretrain_cmd(out, "--set", "train.max_steps=2"), check=True, capture_output=True, timeout=300)
    return out / "final"


def _quantize(*args):
    return CliRunner().invoke(app, ["quantize", *map(str, args)])


@pytest.mark.parametrize(("args", "match"), [
    (["--mode", "qat"], "--mode qat fine-tunes the fake-quantized model, so it needs --data SOURCE"),
    (["--group-size", "64"], ("group size 64 does not divide the in-features 32 of "
                              "model.layers.1.mlp.experts.gate_up_proj; group sizes that divide every selected "
                              "tensor: [16, 32]")),
    (["--method", "w8a16", "--modules", "all_linear"], "format w8a16 does not support the linear modules"),
    (["--modules", "attention"], "quantize.modules 'attention'"),
    (["--method", "nf4"], "quantize.method 'nf4'"),
    (["--set", "quantize.moduls=experts"], "moduls"),
], ids=["qat-without-data", "group-size", "format-modules", "modules", "method", "unknown-key"])
def test_errors_exit_2_and_write_nothing(ckpt, tmp_path, args, match):
    res = _quantize(ckpt, "--out", tmp_path / "out", *args)
    assert res.exit_code == 2, res.output
    assert match in " ".join(res.output.split())
    assert not (tmp_path / "out").exists()


def test_ptq_then_generate_and_an_already_quantized_input(ckpt, tmp_path):
    res = _quantize(ckpt, "--out", tmp_path / "q", "--method", "w4a16", "--modules", "experts", "--group-size", "16")
    assert res.exit_code == 0, res.output
    conf = json.loads((tmp_path / "q" / "final" / "config.json").read_text())["quantization_config"]
    assert conf == {"quant_method": "k3", "format": "w4a16", "group_size": 16,
                    "modules": ["routed_experts", "shared_experts"], "mode": "ptq", "k3_quant_version": 2}
    gen = CliRunner().invoke(app, ["generate", str(tmp_path / "q" / "final"), "--prompt", "def", "--max-tokens", "4",
                                   "--temperature", "0", "--device", "cpu"])
    assert gen.exit_code == 0, gen.output
    again = _quantize(tmp_path / "q" / "final", "--out", tmp_path / "q2")
    assert again.exit_code == 2 and "already quantized (w4a16, ptq)" in again.output
    assert not (tmp_path / "q2").exists()
    exists = _quantize(ckpt, "--out", tmp_path / "q")
    assert exists.exit_code == 2 and "already holds a run" in exists.output


def test_help_names_every_flag():
    res = CliRunner().invoke(app, ["quantize", "--help"], env={"COLUMNS": "200"})
    for flag in ("--out", "--method", "--group-size", "--mode", "--modules", "--data", "--preset", "--config",
                 "--set", "--resume"):
        assert flag in res.output, flag


def test_every_quantize_preset_resolves():
    from k3.cli.config import list_presets, resolve_config

    names = list_presets("quantize")
    assert {"default", "small"} <= set(names)
    for name in names:
        cfg = resolve_config("quantize", preset=name)
        assert cfg.quantize.mode == "ptq" and cfg.model is None and cfg.train.max_steps > cfg.optim.warmup_steps


def test_example_script_and_its_table(tmp_path):
    """examples/quantize/run.sh is valid bash and stops with a hint without a checkpoint; summarize.py turns run
    directories into the README's table (the recovered fraction of the PTQ gap computed from the losses)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "examples" / "quantize"
    assert subprocess.run(["bash", "-n", str(here / "run.sh")], check=False).returncode == 0
    res = subprocess.run(["bash", str(here / "run.sh"), str(tmp_path / "none")], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 2 and "train it first" in res.stderr
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "k3_run.yaml").write_text("stats:\n  final_val_loss: 4.5\n")
    for mods, (bf16, rtn, cal, qat) in {"experts": (4.0, 4.1, 4.05, 4.02), "all": (4.0, 4.2, 4.3, 4.04)}.items():
        for kind, lines in (("ptq", [{"eval": "source", "val_loss": bf16}, {"eval": "rtn", "val_loss": rtn},
                                     {"eval": "calibrated", "val_loss": cal}]),
                            ("qat", [{"step": 60, "loss": 3.0}, {"step": 60, "val_loss": qat}])):
            d = tmp_path / "out" / f"{kind}-{mods}"
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = subprocess.run([sys.executable, str(here / "summarize.py"), str(tmp_path / "ckpt"), str(tmp_path / "out")],
                           capture_output=True, text=True, check=True).stdout
    assert "| routed experts: QAT (same data and steps) | 4.0200 | +0.0200 | 80% |" in table
    assert "| all_linear: calibrated PTQ of the control | 4.3000 | +0.3000 | -50% |" in table
    assert "before fine-tuning) | 4.5000 |" in table
