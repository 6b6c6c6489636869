"""`k3 serve` command: clear errors for a bad checkpoint, and a real server process that reports 503 while
loading, then 200, and answers a completion."""

import os
import subprocess
import sys
import time

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


def test_serve_process_end_to_end(ckpt):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import typer; from k3.cli.commands.serve import serve; typer.run(serve)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(ckpt), "--port", str(port), "--max-model-len", "256",
                             "--max-batch", "2", "--api-key", "k"], env={**os.environ, "K3_KERNELS": "torch"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                statuses.append(httpx.get(url + "/health", timeout=2).status_code)
            except httpx.TransportError:
                statuses.append(None)  # not listening yet
            if statuses[-1] == 200:
                break
            time.sleep(0.05)
        assert statuses[-1] == 200, proc.stdout.read1().decode() if proc.poll() is not None else statuses[-5:]
        assert set(statuses) <= {None, 503, 200}
        r = httpx.post(url + "/v1/completions", json={"prompt": "def", "max_tokens": 3, "temperature": 0,
                                                      "ignore_eos": True}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = proc.stdout.read().decode()
    assert "k3 serve: loading" in log and "k3 serve: ready in" in log, log  # startup progress on stderr
