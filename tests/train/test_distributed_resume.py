"""Resharding on resume: a one-process checkpoint continues on 2 data-parallel ranks, and the DCP checkpoint that
run writes continues on 4, each with the next losses of the uninterrupted one-process run on the same global batch
(4 sequences: 1 x 4, 2 x 2, 4 x 1), within the 1e-5 relative fp32 summation-order tolerance of
test_distributed_pretrain.py. The resumed runs take their config from the run directory, as `--resume` does.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli.config import config_dict, resolve_config
from k3.train.pretrain import run

ROOT = Path(__file__).resolve().parents[2]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def _cut_at(src: Path, dst: Path, step: int) -> None:
    """dst: a copy of run src as it stood after its checkpoint of `step` (later checkpoints, final/ and lines gone)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "final")
    for ck in (dst / "checkpoints").iterdir():
        if int(ck.name.split("-")[1]) > step:
            shutil.rmtree(ck)
    lines = (dst / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dst / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x)["step"] <= step and "loss" in x))


def _resume_on(nproc: int, run_dir: Path, *sets: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "k3.cli.main", "pretrain", "--resume", "--out", str(run_dir), *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_one_process_checkpoint_resumes_on_2_ranks_then_on_4(tmp_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("k3cache")
    sets = [f"data.cache_dir={cache}", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
            "train.max_steps=6", "train.log_every=1", "train.eval_every=0", "train.eval_batches=2",
            "ckpt.every=3", "ckpt.keep_last=10", "train.threads=1", "train.batch_size=4"]
    one = tmp_path / "one"
    cfg = resolve_config("pretrain", preset="debug", sets=sets)
    run(cfg, run_dir=one, run_config={"config": config_dict(cfg)})  # what `k3 pretrain` saves for --resume
    ref = _losses(one)

    two = tmp_path / "two"
    _cut_at(one, two, 3)
    _resume_on(2, two, "parallel.dp=2", "train.batch_size=2", "ckpt.every=4")
    assert (two / "checkpoints" / "step-0000004" / "dcp" / ".metadata").is_file()
    got = _losses(two)
    assert sorted(got) == list(range(1, 7))
    for step in range(4, 7):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step

    four = tmp_path / "four"
    _cut_at(two, four, 4)
    _resume_on(4, four, "parallel.dp=4", "train.batch_size=1")
    got = _losses(four)
    for step in range(5, 7):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
