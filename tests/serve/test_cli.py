"""`k3 serve` command: clear errors for a bad checkpoint, and a real server process that reports 503 while
loading, then 200, and answers a completion."""

import httpx
import typer
from typer.testing import CliRunner

from k3.cli.commands.serve import serve


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    app = typer.Typer()
    app.command("serve")(serve)
    res = CliRunner().invoke(app, [str(tmp_path / "nope")])
    assert res.exit_code == 2
    assert "checkpoint directory not found" in res.output


def test_bad_dtype_or_device_is_a_usage_error(ckpt):
    """An unknown --dtype or --device stops `k3 serve` before anything loads (exit 2, the choices named), and
    ServeConfig refuses them too."""
    import pytest

    from k3.serve.config import ServeConfig

    app = typer.Typer()
    app.command("serve")(serve)
    for flag, value, choice in (("--dtype", "fp8", "bfloat16"), ("--device", "tpu", "cuda:N")):
        res = CliRunner().invoke(app, [str(ckpt), flag, value])
        assert res.exit_code == 2 and choice in res.output, res.output
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServeConfig(dtype="fp8")
    with pytest.raises(ValueError, match="device must be"):
        ServeConfig(device="tpu")
    assert ServeConfig(device="cuda:1", dtype="float16").device == "cuda:1"


def test_serve_process_end_to_end(ckpt, serve_process):
    with serve_process(ckpt, "--max-model-len", "256", "--max-batch", "2", "--api-key", "k") as run:
        statuses = run.statuses
        assert statuses[-1] == 200, run.log or statuses[-5:]
        assert set(statuses) <= {None, 503, 200}
        r = httpx.post(run.url + "/v1/completions", json={"prompt": "def", "max_tokens": 3, "temperature": 0,
                                                          "ignore_eos": True}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    log = run.log
    assert "k3 serve: loading" in log and "k3 serve: ready in" in log, log  # startup progress on stderr
