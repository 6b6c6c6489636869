"""`k3 pretrain` as a shell runs it: a subprocess with piped output (unwrapped lines, exit status 128 + N after a
signal)."""

import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

# the debug preset cut to seconds (tests/train/test_pretrain.py's settings)
FAST = ["--preset", "debug", "--set", "data.max_bytes=400000", "--set", "data.tokenizer_sample_bytes=200000",
        "--set", "train.batch_size=4", "--set", "train.log_every=1", "--set", "train.eval_every=0",
        "--set", "train.eval_batches=2", "--set", "ckpt.every=0", "--set", "train.threads=1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3cache"))


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}
    return {**env, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}  # 80: what rich assumes for a pipe


def _pretrain_cmd(out, cache_dir, *sets):
    return [sys.executable, "-m", "k3.cli", "pretrain", *FAST, "--set", f"data.cache_dir={cache_dir}", *sets,
            "--out", str(out)]


def test_piped_output_keeps_long_paths_on_one_line(tmp_path, cache_dir):
    out = tmp_path / "a-run-directory-whose-name-alone-is-longer-than-half-of-an-80-column-line" / "tiny"
    r = subprocess.run(_pretrain_cmd(out, cache_dir, "--set", "train.max_steps=2"), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=_env(), check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.endswith(f"checkpoint: {out / 'final'}") for line in lines), r.stdout
    assert any(line.endswith(f"run dir {out}") for line in lines), r.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_exits_128_plus_n_after_checkpoint_and_resume_hint(tmp_path, cache_dir, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen(_pretrain_cmd(out, cache_dir, "--set", "train.max_steps=100000"), cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stdout:  # the first log line: the train loop runs, its signal handlers are installed
            seen.append(line)
            if line.startswith("step 1/"):
                proc.send_signal(sig)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stdout = "".join(seen) + rest
    assert proc.returncode == 128 + sig, stdout + err
    assert f"Continue with: k3 pretrain --resume --out {out}" in stdout, stdout
    assert any((d / "COMPLETE").is_file() for d in (out / "checkpoints").iterdir())


def test_ctrl_c_before_the_train_loop_exits_130(tmp_path, monkeypatch):
    # Ctrl-C while the data is prepared or the model is built: Python's KeyboardInterrupt, not the loop's handler
    import k3.train.pretrain
    from k3.cli.main import app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(k3.train.pretrain, "run", interrupted)
    res = CliRunner().invoke(app, ["pretrain", "--preset", "debug", "--out", str(tmp_path / "run")])
    assert res.exit_code == 130 and res.stderr == "interrupted\n", res.output
