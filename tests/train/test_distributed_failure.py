"""What a multi-process `k3 pretrain` does when a rank is lost, and the layouts it refuses before starting.

The ranks are started here as a launcher starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), without
torchrun's agent, which would otherwise kill the survivors itself: a rank killed mid-run (SIGKILL) and a rank that
stops answering (SIGSTOP, caught by parallel.timeout_s) both make the other rank exit with code 2 and one line that
names the failed collective and the way back (--resume), and the last checkpoint stays loadable.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3.cli.config import resolve_config
from k3.model.config import ConfigError
from k3.train.checkpoint import load_checkpoint
from k3.train.pretrain import run

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(run_dir: Path, sets: list[str], world: int = 2) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "k3.cli.main", "pretrain", "--preset", "debug", "--out", str(run_dir),
               *(a for s in sets for a in ("--set", s))]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _wait_for_step(run_dir: Path, step: int, procs, limit: float = 90) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        m = run_dir / "metrics.jsonl"
        if m.is_file() and any(json.loads(x).get("step", 0) >= step for x in m.read_text().splitlines()):
            return
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {limit} s")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("k3cache")


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_rank_stops_the_other_with_a_clear_message(tmp_path, cache, how):
    sets = [f"data.cache_dir={cache}", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
            "train.max_steps=400", "train.log_every=1", "train.eval_every=0", "ckpt.every=2", "train.batch_size=2",
            "parallel.dp=2", "parallel.timeout_s=5"]
    run_dir = tmp_path / "run"
    procs = _start_ranks(run_dir, sets)
    try:
        _wait_for_step(run_dir, 3, procs)
        procs[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=60)
        took = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 2, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("error: rank 0 of 2:")]
    assert line and "--resume" in line[0] and "Traceback" not in err, err[-3000:]
    if how == "stopped":
        assert "parallel.timeout_s=5" in line[0] and took >= 4.5, (took, line)
    ck = max((run_dir / "checkpoints").glob("step-*"))
    assert load_checkpoint(ck)["train_state"]["step"] >= 2  # whole, and readable on one process


def test_sigterm_on_one_rank_stops_every_rank_at_one_checkpoint(tmp_path, cache):
    sets = [f"data.cache_dir={cache}", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
            "train.max_steps=400", "train.log_every=1", "train.eval_every=0", "ckpt.every=0", "train.batch_size=2",
            "parallel.dp=2"]
    run_dir = tmp_path / "run"
    procs = _start_ranks(run_dir, sets)
    try:
        _wait_for_step(run_dir, 2, procs)
        procs[1].send_signal(signal.SIGTERM)  # rank 1 alone: the ranks agree on the stop at the step's end
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, [o[1][-2000:] for o in outs]
    stop = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "event" in x]
    assert len(stop) == 1 and stop[0]["event"] == "stopped_by_signal"
    ck = load_checkpoint(stop[0]["checkpoint"])
    assert ck["format"] == "dcp" and ck["train_state"]["step"] == stop[0]["step"]
    assert "Continue with: k3 pretrain --resume" in outs[0][0]


def test_layouts_refused_before_anything_is_written(tmp_path, monkeypatch):
    base = ["data.max_bytes=400000", "train.max_steps=2"]
    with pytest.raises(ConfigError, match=r"1 x 1 x 1 = 1, but the world size is 2.*torchrun --nproc_per_node 1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        run(resolve_config("pretrain", preset="debug", sets=base), run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"parallel.redundant_experts=1: .* not wired into the EP dispatch yet"):
        run(resolve_config("pretrain", preset="debug", sets=[*base, "parallel.ep=2", "parallel.redundant_experts=1"]),
            run_dir=tmp_path / "b")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"parallel.dp=2 x parallel.ep=2: .* model.num_experts \(6\) must be "
                                          r"divisible by 4"):
        run(resolve_config("pretrain", preset="debug",
                           sets=[*base, "parallel.dp=2", "parallel.ep=2", "model.num_experts=6"]),
            run_dir=tmp_path / "b2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallel.cp=2: context parallelism .* is not built yet"):
        run(resolve_config("pretrain", preset="debug", sets=[*base, "parallel.cp=2"]), run_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match=r"`k3 extend-context` runs on one process"):
        cfg = resolve_config("pretrain", preset="debug", sets=base)
        cfg.parallel = None  # a command without the section
        run(cfg, run_dir=tmp_path / "d", command="k3 extend-context")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"parallel.dp x parallel.ep x parallel.cp = 2 x 1 x 1 = 2, but the world "
                                          r"size is 1; launch 2 processes \(torchrun --nproc_per_node 2\)"):
        run(resolve_config("pretrain", preset="debug", sets=[*base, "parallel.dp=2"]), run_dir=tmp_path / "e")
    assert not any((tmp_path / n).exists() for n in ("a", "b", "b2", "c", "d", "e"))
