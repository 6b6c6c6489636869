"""`k3 eval lm` without lm-evaluation-harness installed: its help, and the errors that come before anything starts
(a bad checkpoint path, lm-eval missing). The runs against a server: tests/serve/test_eval_lm.py (the `eval` extra)."""

import json
import sys

from typer.testing import CliRunner

from k3.cli.main import app
from k3.model.checkpoint import K3_FORMAT_VERSION, MODEL_TYPE

runner = CliRunner()


def test_help_lists_the_flags():
    res = runner.invoke(app, ["eval", "lm", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for flag in ("--tasks", "--include-path", "--limit", "--num-fewshot", "--batch-size", "--device", "--dtype",
                 "--port", "--output"):
        assert flag in res.output, flag
    assert "pip install -e '.[eval]'" in res.output


def test_a_bad_checkpoint_path_is_one_line_before_anything_starts(tmp_path):
    res = runner.invoke(app, ["eval", "lm", str(tmp_path / "nope"), "--tasks", "x"])
    assert res.exit_code == 2 and "checkpoint directory not found" in res.output, res.output
    (tmp_path / "run" / "final").mkdir(parents=True)
    res = runner.invoke(app, ["eval", "lm", str(tmp_path / "run"), "--tasks", "x"])
    assert res.exit_code == 2 and "missing config.json" in res.output, res.output
    assert "Traceback" not in res.output


def test_missing_lm_eval_names_the_extra(tmp_path, monkeypatch):
    from k3.cli.config import load_model_config

    ckpt = tmp_path / "final"
    ckpt.mkdir()  # a config that validates: the lm-eval check comes next, before weights or a server
    cfg = {"model_type": MODEL_TYPE, **load_model_config("k3-debug").to_dict(), "k3_format_version": K3_FORMAT_VERSION}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    res = runner.invoke(app, ["eval", "lm", str(ckpt), "--tasks", "hellaswag"])
    assert res.exit_code == 2, res.output
    assert "lm-evaluation-harness is not installed" in res.output and "pip install -e '.[eval]'" in res.output
