"""`k3 generate` as a shell runs it: a device this torch cannot use is one line and exit 2 (`k3 serve` too); a
prompt plus --max-tokens past the checkpoint's trained sequence length warns in one line on stderr and still
generates."""

import os
import subprocess
import sys

import pytest
import torch

from k3.model.tokenizer import K3Tokenizer
from k3.train.quantize import quantize_release


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, pretrain_cmd):
    """k3-debug after 2 steps at data.seq_len=64 (what its k3_run.yaml records)."""
    root = tmp_path_factory.mktemp("generate_ckpt")
    r = subprocess.run(pretrain_cmd(root / "run", "--set", "train.max_steps=2"), capture_output=True, text=True,
                       timeout=300, cwd=root, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "run" / "final"


def _generate(ckpt, *args, cwd):
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "k3.cli", "generate", str(ckpt), "--prompt", "def ", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU that --device cuda can use")
def test_device_cuda_without_cuda_is_one_line_and_exit_2(ckpt, tmp_path):
    r = _generate(ckpt, "--device", "cuda", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    reason = "is a CPU-only build" if torch.version.cuda is None else "sees no GPU"
    assert r.stderr.startswith("error: --device cuda: ") and reason in r.stderr and "--device cpu" in r.stderr


def test_unknown_device_is_one_line_and_exit_2(ckpt, tmp_path):
    r = _generate(ckpt, "--device", "gpu", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: --device 'gpu': unknown device; use auto, cpu, cuda or cuda:N\n")


def test_max_tokens_past_the_trained_length_warns_once_and_generates(ckpt, tmp_path):
    n = len(K3Tokenizer.from_file(ckpt).encode("def ", add_bos=True))
    quantized = quantize_release(ckpt, tmp_path / "w4a8")  # its k3_run.yaml holds the trained run as parent_run
    for release in (ckpt, quantized):
        r = _generate(release, "--max-tokens", "70", "--temperature", "0", "--device", "cpu", cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
        expected = (f"warning: the prompt ({n} tokens) and --max-tokens 70 run past the 64 tokens this checkpoint was "
                    f"trained on (data.seq_len in {release / 'k3_run.yaml'}); text beyond them is likely degraded: "
                    f"use --max-tokens {64 - n} for the trained length")
        assert warnings == [expected], r.stderr
        assert r.stdout.startswith("def ") and "[70 tokens in" in r.stderr  # greedy: no EOS this early
    r = _generate(ckpt, "--max-tokens", str(64 - n), "--temperature", "0", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU that --device cuda can use")
def test_serve_device_cuda_without_cuda_is_one_line_and_exit_2(ckpt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3.cli", "serve", str(ckpt), "--device", "cuda"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, check=False)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: serve.device cuda: ") and "serve.device cpu" in r.stderr
