"""Training checkpoints: bit-exact resume state, keep-last pruning, atomicity under SIGKILL, loud errors."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from k3.model.checkpoint import CheckpointError
from k3.train.checkpoint import COMPLETE, Checkpointer, load_checkpoint, restore_rng
from k3.train.config import CheckpointConfig


def make_model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train_steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 8, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def save_step(ck, step, model, opt, **kw):
    return ck.save(step, model_state=model.state_dict(), optim_state=opt.state_dict(),
                   data_state={"pos": step * 10, "epoch": 0}, **kw)


def test_round_trip_resumes_bit_exact(tmp_path):
    model, opt = make_model_and_opt()
    train_steps(model, opt, 3, seed=1)
    ck = Checkpointer(CheckpointConfig(keep_last=2), tmp_path)
    path = ck.save(3, model_state=model.state_dict(), optim_state=opt.state_dict(),
                   data_state={"pos": 123, "order": [3, 1, 2]}, tokens=4096, best_val_loss=float("inf"),
                   elapsed_s=1.5, extra={"lr": 0.01})
    assert path == tmp_path / "checkpoints" / "step-0000003"

    state = ck.load()
    assert state["path"] == path
    assert state["data_state"] == {"pos": 123, "order": [3, 1, 2]}
    ts = state["train_state"]
    assert (ts["step"], ts["tokens"], ts["best_val_loss"], ts["elapsed_s"], ts["lr"]) == (3, 4096, float("inf"),
                                                                                         1.5, 0.01)
    model2, opt2 = make_model_and_opt()
    model2.load_state_dict(state["model_state"])
    opt2.load_state_dict(state["optim_state"])
    for k, v in model.state_dict().items():
        assert bit_equal(v, model2.state_dict()[k]), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert bit_equal(s1["state"][i][name], s2["state"][i][name]), (i, name)
    # continuing both runs gives identical weights: the resume is exact
    train_steps(model, opt, 2, seed=7)
    train_steps(model2, opt2, 2, seed=7)
    for k, v in model.state_dict().items():
        assert bit_equal(v, model2.state_dict()[k]), k


def test_rng_restore_reproduces_next_numbers(tmp_path):
    model, opt = make_model_and_opt()
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    path = save_step(Checkpointer(CheckpointConfig(), tmp_path), 1, model, opt)
    expect = (random.random(), np.random.rand(3), torch.rand(4))
    for _ in range(3):  # move every generator on
        random.random(), np.random.rand(5), torch.rand(5)
    assert Checkpointer.restore_rng is restore_rng  # the loop restores through its Checkpointer
    restore_rng(load_checkpoint(path)["rng"])
    got = (random.random(), np.random.rand(3), torch.rand(4))
    assert got[0] == expect[0]
    assert np.array_equal(got[1], expect[1])
    assert torch.equal(got[2], expect[2])


def test_keep_last_pruning_and_latest(tmp_path):
    model, opt = make_model_and_opt()
    ck = Checkpointer(CheckpointConfig(keep_last=2), tmp_path)
    assert ck.latest() is None
    for step in (1, 2, 3, 10):
        save_step(ck, step, model, opt)
    assert [p.name for p in ck.completed()] == ["step-0000003", "step-0000010"]
    assert sorted(p.name for p in ck.dir.iterdir()) == ["step-0000003", "step-0000010"]
    assert ck.latest() == ck.dir / "step-0000010"
    # saving an existing step replaces it
    save_step(ck, 10, model, opt, extra={"note": "again"})
    assert ck.load()["train_state"]["note"] == "again"


def test_latest_ignores_incomplete_dirs(tmp_path):
    model, opt = make_model_and_opt()
    ck = Checkpointer(CheckpointConfig(keep_last=3), tmp_path)
    save_step(ck, 4, model, opt)
    (ck.dir / "step-0000009").mkdir()  # no COMPLETE marker
    tmp = ck.dir / ".tmp-step-0000010-999"
    tmp.mkdir()
    (tmp / COMPLETE).write_text("{}")
    (ck.dir / "notes").mkdir()
    assert ck.latest() == ck.dir / "step-0000004"
    with pytest.raises(CheckpointError, match="COMPLETE"):
        load_checkpoint(ck.dir / "step-0000009")
    ck2 = Checkpointer(CheckpointConfig(keep_last=3), tmp_path)  # a new writer removes stale temp dirs only
    assert not tmp.exists() and (ck.dir / "step-0000009").exists()
    assert ck2.latest() == ck.dir / "step-0000004"


def test_errors_name_the_file(tmp_path):
    model, opt = make_model_and_opt()
    with pytest.raises(CheckpointError, match="--resume"):
        Checkpointer(CheckpointConfig(), tmp_path / "empty").load()
    with pytest.raises(CheckpointError, match="keep_last"):
        Checkpointer(CheckpointConfig(keep_last=0), tmp_path)
    ck = Checkpointer(CheckpointConfig(keep_last=5), tmp_path)

    p = save_step(ck, 1, model, opt)
    (p / "optim.pt").unlink()
    with pytest.raises(CheckpointError, match="optim.pt: missing"):
        ck.load(p)

    p = save_step(ck, 2, model, opt)
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        ck.load(p)

    p = save_step(ck, 3, model, opt)
    size = (p / "optim.pt").stat().st_size
    (p / "optim.pt").write_bytes(b"\0" * size)  # same size, garbage content
    with pytest.raises(CheckpointError, match="optim.pt: corrupt"):
        ck.load(p)

    p = save_step(ck, 4, model, opt)
    size = (p / "data.json").stat().st_size
    (p / "data.json").write_text("{\"pos\": ".ljust(size))  # same size, cut JSON
    with pytest.raises(CheckpointError, match="data.json: corrupt JSON"):
        load_checkpoint(p)

    with pytest.raises(CheckpointError, match="data_state"):
        ck.save(5, model_state=model.state_dict(), optim_state=opt.state_dict(), data_state={"pos": object()})
    with pytest.raises(CheckpointError, match="tokens"):
        save_step(ck, 5, model, opt, tokens=1, extra={"tokens": 2})
    assert not any(n.name.startswith((".tmp", "step-0000005")) for n in ck.dir.iterdir())


CHILD = textwrap.dedent("""
    import sys, time
    import torch
    from k3.train import checkpoint as C
    from k3.train.config import CheckpointConfig

    def weights(step):  # ~50 MB, so the write takes a moment
        return {"w": torch.randn(12_500_000, generator=torch.Generator().manual_seed(step))}

    ck = C.Checkpointer(CheckpointConfig(keep_last=3), sys.argv[1])
    ck.save(1, model_state=weights(1), optim_state={"state": {}, "param_groups": []}, data_state={"pos": 1})
    print("SAVED1", flush=True)
    real_save = C._torch_save
    def stall(obj, path):  # the parent kills us here: model.safetensors and optim.pt written, the rest not
        real_save(obj, path)
        print("INSIDE", flush=True)
        time.sleep(600)
    C._torch_save = stall
    ck.save(2, model_state=weights(2), optim_state={"state": {}, "param_groups": []}, data_state={"pos": 2})
    print("SAVED2", flush=True)
""")


def test_sigkill_during_write_keeps_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines == ["SAVED1", "INSIDE"], (lines, proc.stderr.read() if proc.poll() is not None else "")
        tmp = run_dir / "checkpoints" / f".tmp-step-0000002-{proc.pid}"
        assert (tmp / "model.safetensors").is_file() and not (tmp / COMPLETE).exists()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    assert not (run_dir / "checkpoints" / "step-0000002").exists()
    ck = Checkpointer(CheckpointConfig(keep_last=3), run_dir)
    assert not tmp.exists()  # the stale temp dir is cleaned on start
    assert ck.latest() == run_dir / "checkpoints" / "step-0000001"
    state = ck.load()
    expect = torch.randn(12_500_000, generator=torch.Generator().manual_seed(1))
    assert bit_equal(state["model_state"]["w"], expect)
    assert state["data_state"] == {"pos": 1} and state["train_state"]["step"] == 1
    assert json.loads((state["path"] / COMPLETE).read_text())["step"] == 1
