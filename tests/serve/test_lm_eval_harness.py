"""lm-evaluation-harness itself against `k3 serve`: its `local-completions` model with tokenized_requests=False and
the default tokenizer backend (auto: the server's /tokenizer_info, then /tokenize and /detokenize), on the local
multiple-choice task in lm_eval_task/ (no downloads). Every log-likelihood it reports equals K3Model's own over the
same tokens within 1e-4. Needs the `eval` extra (`pip install -e '.[eval]'`); skipped without it."""

import shutil
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra")

TASK_DIR = Path(__file__).parent / "lm_eval_task"
MODEL = "k3-test"






def test_lm_eval_local_completions_matches_the_model(server, model_tok, tmp_path, monkeypatch, lm_eval_reference):
    from lm_eval.tasks import TaskManager

    model, tok = model_tok
    for name in ("k3_python_mc.yaml", "k3_python_mc.jsonl"):
        shutil.copy(TASK_DIR / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)  # the task's data_files path is relative
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenized_requests=False,max_retries=1",
        tasks=["k3_python_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
        num_fewshot=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    samples = results["samples"]["k3_python_mc"]
    docs = [line for line in (TASK_DIR / "k3_python_mc.jsonl").read_text().splitlines() if line]
    assert len(samples) == len(docs)
    checked = 0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
            got = resp[0][0]
            ctx, cont = lm_eval_reference.split(tok, context, continuation)
            want = lm_eval_reference.loglikelihood(model, ctx, cont)
            assert got == pytest.approx(want, abs=1e-4), (context, continuation, got, want)
            checked += 1
    assert checked == sum(len(s["arguments"]) for s in samples) >= 20
    acc = results["results"]["k3_python_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
