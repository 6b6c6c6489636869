"""Running k3 commands as a shell does: subprocesses with piped output, from a directory outside the repository."""

import os
import sys

import pytest

# the debug preset cut to seconds (tests/train/test_pretrain.py's settings)
FAST_SETS = ["data.max_bytes=400000", "data.tokenizer_sample_bytes=200000", "train.batch_size=4", "train.log_every=1",
             "train.eval_every=0", "train.eval_batches=2", "ckpt.every=0", "train.threads=1"]


@pytest.fixture(scope="session")
def pretrain_cmd(tmp_path_factory):
    """pretrain_cmd(run_dir, *more_args) -> the argv of a debug `k3 pretrain` of a few seconds (one shared data
    cache), e.g. pretrain_cmd(out, "--set", "train.max_steps=2")."""
    cache = tmp_path_factory.mktemp("k3cache")

    def cmd(out, *args):
        sets = [a for s in [*FAST_SETS, f"data.cache_dir={cache}"] for a in ("--set", s)]
        return [sys.executable, "-m", "k3.cli", "pretrain", "--preset", "debug", *sets, *args, "--out", str(out)]

    return cmd


@pytest.fixture
def piped_env():
    """The environment of a pipe at 80 columns (what rich assumes there), unbuffered, without forced colours."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}
    return {**env, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
