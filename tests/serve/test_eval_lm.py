"""`k3 eval lm` end to end, as a user runs it (`python -m k3.cli eval lm` in its own process, which starts `k3 serve`
as a subprocess): the local multiple-choice task (loglikelihood) and the local generate_until task of lm_eval_task/
(no downloads). Every log-likelihood it reports equals K3Model's own over lm-eval's tokens, every generation equals
a greedy decode by full forward passes of the model cut at the task's stop string, exact_match is recomputed from
those, and the server is gone afterwards; also on a server that fails to start and on Ctrl-C inside the run.
Needs the `eval` extra (`pip install -e '.[eval]'`); skipped without it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra")

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASKS = ("k3_python_mc", "k3_python_gen")


def _docs(task: str) -> list[dict]:
    return [json.loads(line) for line in (TASK_DIR / f"{task}.jsonl").read_text().splitlines() if line]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path) -> dict:
    # offline: the local tasks need no network, and a lookup must not be what makes the test slow or flaky
    return {**os.environ, "K3_KERNELS": "torch", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}


def _k3_eval_lm(tmp_path, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "k3.cli", "eval", "lm", *map(str, args)], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=timeout, check=False)


def _down(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.TransportError:
        return True
    return False






def _greedy(model, tok, prompt: str, max_new: int, until: str) -> str:
    """Greedy decoding by a full forward pass per token (no cache: independent of the server's prefill + recurrent
    decode), stopped at EOS or max_new tokens, the text cut before the first `until`."""
    ids = tok.encode(prompt, add_special_tokens=True)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == tok.eos_id:
                break
            new.append(nxt)
    return tok.decode(new).split(until)[0]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A copy of lm_eval_task/ to run from (the tasks' data_files are relative to the working directory)."""
    d = tmp_path_factory.mktemp("eval_lm")
    for f in TASK_DIR.iterdir():
        shutil.copy(f, d / f.name)
    return d


def test_eval_lm_runs_both_task_kinds_and_matches_the_model(ckpt, model_tok, task_dir, lm_eval_reference):
    model, tok = model_tok
    port = _free_port()
    res = _k3_eval_lm(task_dir, ckpt, "--tasks", ",".join(TASKS), "--include-path", ".", "--device", "cpu",
                      "--port", port, "--batch-size", 2, "--output", "out/results.json", "--log-samples")
    assert res.returncode == 0, res.stdout + res.stderr
    assert _down(port), "the server outlived `k3 eval lm`"
    for task in TASKS:
        assert task in res.stdout, res.stdout  # the results table
    out = json.loads((task_dir / "out" / "results.json").read_text())

    mc = out["samples"]["k3_python_mc"]
    assert len(mc) == len(_docs("k3_python_mc"))
    correct = 0
    for s in mc:
        got = [resp[0][0] for resp in s["resps"]]
        ref = lm_eval_reference
        want = [ref.loglikelihood(model, *ref.split(tok, c, x)) for c, x in s["arguments"]]
        assert got == pytest.approx(want, abs=1e-4), (s["arguments"], got, want)
        correct += max(range(len(want)), key=want.__getitem__) == s["doc"]["answer"]
    assert out["results"]["k3_python_mc"]["acc,none"] == pytest.approx(correct / len(mc))

    gen = out["samples"]["k3_python_gen"]
    docs = _docs("k3_python_gen")
    assert len(gen) == len(docs)
    matches = 0
    for s in gen:
        prompt, kwargs = s["arguments"][0]
        assert prompt == s["doc"]["prompt"] and kwargs["until"][0] == "\n" and kwargs["max_gen_toks"] == 16
        want = _greedy(model, tok, prompt, 16, "\n")
        assert s["resps"][0][0] == want, (prompt, s["resps"][0][0], want)
        matches += want == s["doc"]["target"]
    assert out["results"]["k3_python_gen"]["exact_match,none"] == pytest.approx(matches / len(gen))
    assert any(s["resps"][0][0] for s in gen)  # the model generated text, not only empty strings


def test_limit_and_unknown_task(ckpt, task_dir):
    res = _k3_eval_lm(task_dir, ckpt, "--tasks", "k3_python_mcq", "--include-path", ".")
    assert res.returncode == 2 and "unknown lm-eval task 'k3_python_mcq'" in res.stderr, res.stderr
    assert "k3_python_mc" in res.stderr and "k3 serve" not in res.stdout  # a suggestion; no server started
    res = _k3_eval_lm(task_dir, ckpt, "--tasks", "k3_python_mc", "--include-path", ".", "--limit", 3, "--device",
                      "cpu", "--output", "r.json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((task_dir / "r.json").read_text())["n-samples"]["k3_python_mc"]["effective"] == 3


def test_a_server_that_fails_to_start_is_reported_with_its_log(ckpt, task_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model.safetensors").unlink()  # config.json reads fine; loading the weights fails in the server
    res = _k3_eval_lm(task_dir, broken, "--tasks", "k3_python_mc", "--include-path", ".", "--device", "cpu")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "k3 serve exited with code" in res.stderr and "missing weights" in res.stderr, res.stderr


def test_the_server_is_stopped_on_ctrl_c_and_on_errors(ckpt, monkeypatch):
    from k3.serve.lm_eval import served

    monkeypatch.setenv("K3_KERNELS", "torch")
    for exc in (KeyboardInterrupt, RuntimeError):
        port = _free_port()
        with pytest.raises(exc), served(ckpt, port=port, device="cpu") as (url, name):
            assert httpx.get(url + "/health").status_code == 200 and name == ckpt.name
            raise exc
        assert _down(port)
