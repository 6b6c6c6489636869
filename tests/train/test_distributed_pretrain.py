"""`k3 pretrain` on 2 data-parallel processes (torchrun, gloo, CPU) against one process on the same global batch.

A DP=2 run with train.batch_size=2 reads the rows of a one-process run with batch_size=4 (k3.train.parallel.data),
so the two must agree step for step: losses, gradient norms, QK-Clip (tau set low so heads clip every step, through
the max logits reduced over ranks), Quantile Balancing (router scores gathered), the final validation loss and the
released weights. Tolerance 1e-5 relative: the runs differ only in fp32 summation order (each rank's mean CE over
half the rows, then the mean of the two; FSDP2's reduce-scatter adds the two ranks' gradients), which moves a loss
by about 1e-7 here. Its DCP checkpoint then resumes on one process with the same next losses.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.cli.config import resolve_config
from k3.model.checkpoint import load_release
from k3.train.checkpoint import load_checkpoint
from k3.train.pretrain import run

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["data.max_bytes=400000", "data.tokenizer_sample_bytes=200000", "train.max_steps=10", "train.log_every=1",
          "train.eval_every=0", "train.eval_batches=2", "ckpt.every=5", "train.threads=1", "optim.qk_clip_tau=0.05"]
TOL = 1e-5


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3cache"))


def _sets(cache_dir, *more):
    return [f"data.cache_dir={cache_dir}", *COMMON, *more]


def torchrun(nproc: int, run_dir: Path, sets: list[str], *, resume: bool = False, timeout: float = 120):
    """`torchrun --standalone --nproc_per_node N -m k3.cli.main pretrain --preset debug --set ...`, checked."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "k3.cli.main", "pretrain", "--preset", "debug", "--out", str(run_dir)]
    cmd += [a for s in sets for a in ("--set", s)] + (["--resume"] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir) if "loss" in r}


def assert_close_steps(a: dict[int, dict], b: dict[int, dict], keys=("loss", "grad_norm", "mtp_loss")):
    assert sorted(a) == sorted(b)
    for step in a:
        for k in keys:
            assert a[step][k] == pytest.approx(b[step][k], rel=TOL), (step, k, a[step][k], b[step][k])
        for k in ("qk_clipped_heads", "tokens"):
            assert a[step][k] == b[step][k], (step, k)
        assert a[step]["router_cv"] == pytest.approx(b[step]["router_cv"], abs=1e-6), step


def test_dp2_equals_one_process_and_its_dcp_checkpoint_resumes_on_one(tmp_path, cache_dir):
    one, dp2, back = tmp_path / "one", tmp_path / "dp2", tmp_path / "back"
    run(resolve_config("pretrain", preset="debug", sets=_sets(cache_dir, "train.batch_size=4")), run_dir=one)
    out = torchrun(2, dp2, _sets(cache_dir, "train.batch_size=2", "parallel.dp=2"))
    assert out.stdout.count("done step 10") == 1  # rank 0 alone prints

    s_one, s_dp2 = steps(one), steps(dp2)
    assert len(s_one) == 10 and all(r["qk_clipped_heads"] > 0 for r in s_one.values())  # QK-Clip is exercised
    assert_close_steps(s_one, s_dp2)
    val = [r["val_loss"] for r in metrics(one) if "val_loss" in r], [r["val_loss"] for r in metrics(dp2)
                                                                     if "val_loss" in r]
    assert val[0] == pytest.approx(val[1], rel=TOL)
    assert len(metrics(dp2)) == len(metrics(one))  # one writer: no line twice

    # the training checkpoints are DCP with one file per rank; final/ is the one-file release
    ck = dp2 / "checkpoints" / "step-0000005"
    complete = json.loads((ck / "COMPLETE").read_text())
    assert complete["format"] == "dcp" and {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(complete["files"])
    assert not (ck / "model.safetensors").exists()
    _, w_one = load_release(one / "final")
    _, w_dp2 = load_release(dp2 / "final")
    assert w_one.keys() == w_dp2.keys()
    for k in w_one:
        torch.testing.assert_close(w_dp2[k], w_one[k], rtol=1e-4, atol=1e-5, msg=k)

    # read whole on one process, the DCP checkpoint holds what the one-process checkpoint holds
    a, b = load_checkpoint(one / "checkpoints" / "step-0000005"), load_checkpoint(ck)
    assert a["model_state"].keys() == b["model_state"].keys() and a["data_state"] == b["data_state"]
    for k in a["model_state"]:
        torch.testing.assert_close(b["model_state"][k], a["model_state"][k], rtol=1e-4, atol=1e-6, msg=k)
    assert len(b["optim_state"]["state"]) == len(a["optim_state"]["state"])

    # resume the DP=2 run at step 5 on one process with the same global batch: the same next losses
    shutil.copytree(dp2, back)
    shutil.rmtree(back / "checkpoints" / "step-0000010")
    shutil.rmtree(back / "final")
    (back / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics(dp2)[:5]))
    run(resolve_config("pretrain", preset="debug", sets=_sets(cache_dir, "train.batch_size=4")), run_dir=back,
        resume=True)
    assert_close_steps(steps(back), s_dp2)
