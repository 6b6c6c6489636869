"""`k3 serve` command: clear errors for a bad checkpoint, a port in use and a missing serve extra (one line, exit
2), and a real server process that reports 503 while loading, then 200, and answers a completion."""

import os
import shutil
import socket
import subprocess
import sys

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
    from k3.model.checkpoint import load_model
    from k3.model.transformer import count_parameters, describe_parameters

    size = describe_parameters(count_parameters(load_model(ckpt)[0]))
    assert f"loaded {size}" in log, log  # the size line k3 pretrain prints for this checkpoint


def _serve(*args, prelude: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """`k3 serve ARGS` as its own process, to its exit (the serve_process fixture's invocation)."""
    code = prelude + "import typer; from k3.cli.commands.serve import serve; typer.run(serve)"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "K3_KERNELS": "torch"}, check=False)


def test_port_in_use_is_one_line_and_exit_2(ckpt):
    """A port another process listens on: exit 2 and one line naming the port and the fix (it was an abort, rc 134,
    "terminate called without an active exception", once uvicorn's bind failure exited under the loading thread)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = _serve(ckpt, "--port", port)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"port {port}" in errors[0] and "--port" in errors[0], out
    assert "Traceback" not in out and "terminate called" not in out


def test_corrupt_weights_exit_with_k3_generates_error(ckpt, tmp_path):
    """config.json fine, model.safetensors truncated: `k3 serve` stops (it answered 503 "loading" for ever, after a
    thread traceback) and exits 2 with the same one-line error `k3 generate` prints for the checkpoint."""
    from k3.cli.commands.generate import generate

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    weights = bad / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    app = typer.Typer()
    app.command("generate")(generate)
    gen = CliRunner().invoke(app, [str(bad), "--prompt", "x", "--max-tokens", "1"])
    assert gen.exit_code == 2
    want = gen.output.strip().splitlines()[-1]
    assert want.startswith("error:") and "model.safetensors" in want
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _serve(bad, "--port", port, "--log-level", "error")
    out = (res.stdout + res.stderr).strip()
    assert res.returncode == 2, out
    assert out.splitlines()[-1] == want, out
    assert "Traceback" not in out and "Exception in thread" not in out


def test_missing_serve_extra_is_a_one_line_hint(ckpt):
    """Without fastapi (the serve extra) `k3 serve` prints one line with the install command, exit 2 (it was a
    36-line ModuleNotFoundError traceback); the error is still an ImportError for code that imports the server."""
    res = _serve(ckpt, prelude="import sys; sys.modules['fastapi'] = None; ")
    out = (res.stdout + res.stderr).strip()
    assert res.returncode == 2 and len(out.splitlines()) == 1, out
    assert "pip install 'k3[serve]'" in out and "fastapi" in out
    probe = ("import sys; sys.modules['fastapi'] = None\ntry:\n    import k3.serve.server\n"
             "except ImportError as e:\n    print(type(e).__name__, e.name)")
    check = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert check.stdout.strip() == "MissingServeExtra fastapi", check.stdout + check.stderr
