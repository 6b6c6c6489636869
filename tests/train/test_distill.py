"""`k3 distill` on k3-debug: routing, masking, generation against `k3 generate`'s path, SIGTERM + --resume, and the
errors that stop before any work."""

import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from k3.cli.config import resolve_config
from k3.cli.main import app
from k3.model.checkpoint import load_model, load_release, save_release
from k3.model.config import ConfigError
from k3.model.tokenizer import K3Tokenizer, train_bpe
from k3.model.transformer import build_model
from k3.serve.generate import generate_batch, stream_text
from k3.train import loop as loop_mod
from k3.train.distill import DistillBatches, run
from k3.train.distill_data import ALL, PromptSampler, read_prompts
from k3.train.pretrain import run as pretrain_run

PROMPTS = [{"prompt": "def add(a, b):", "teacher": "a"}, {"prompt": "import os\n", "teacher": "b"},
           {"messages": [{"role": "user", "content": "hello"}]}, {"prompt": "class Foo:"}]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A k3-debug student trained for a few steps and two teachers: its weights plus independent noise."""
    root = tmp_path_factory.mktemp("distill")
    sets = ["train.max_steps=8", "train.batch_size=4", "data.max_bytes=300000", "data.tokenizer_sample_bytes=200000",
            f"data.cache_dir={root / 'cache'}", "train.eval_every=0", "train.eval_batches=1", "ckpt.every=0",
            "train.log_every=8", "train.threads=1"]
    pretrain_run(resolve_config("pretrain", preset="debug", sets=sets), run_dir=root / "student")
    student = root / "student" / "final"
    cfg, sd = load_release(student)
    g = torch.Generator().manual_seed(1)
    for name in ("a", "b"):
        noisy = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in sd.items()}
        save_release(root / name, noisy, cfg, tokenizer_dir=student)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def _cfg(*sets):
    base = ["train.max_steps=6", "train.batch_size=3", "distill.max_new_tokens=6", "train.log_every=1",
            "train.threads=1", "optim.warmup_steps=1", "ckpt.every=3", "distill.default_teacher=a"]
    return resolve_config("distill", preset="default", sets=[*base, *sets])


def _run(ckpts, out, *sets, resume=False):
    return run(_cfg(*sets), student=ckpts / "student" / "final", teachers={"a": ckpts / "a", "b": ckpts / "b"},
               prompts=ckpts / "prompts.jsonl", run_dir=out, generate=generate_batch, resume=resume)


def test_routing_named_uniform_all(ckpts):
    tok = K3Tokenizer.from_file(ckpts / "student" / "final")
    plist = read_prompts(ckpts / "prompts.jsonl", tok, ["a", "b"], context=256, max_new_tokens=8)
    assert plist[2].ids == tuple(tok.encode(tok.apply_chat_template(PROMPTS[2]["messages"])))
    assert plist[0].ids == tuple(tok.encode("def add(a, b):", add_bos=True))
    by_line = {}
    for routing, default in (("named", "b"), ("uniform", None), ("all", None)):
        s = PromptSampler(plist, ["a", "b"], routing=routing, default_teacher=default, batch_size=64, seed=0)
        prompts, routes, _, _ = next(s)
        by_line[routing] = [(p.line, r) for p, r in zip(prompts, routes)]
        for p, r in zip(prompts, routes):
            if p.teacher is not None:
                assert r == ["a", "b"].index(p.teacher)  # a named line goes to its teacher under every routing
            elif routing == "named":
                assert r == 1
            elif routing == "all":
                assert r == ALL
    unnamed = {r for line, r in by_line["uniform"] if line > 2}
    assert unnamed == {0, 1}  # uniform draws both teachers for the unnamed lines
    with pytest.raises(ConfigError, match=r"prompts.jsonl:3: no 'teacher' and no distill.default_teacher"):
        PromptSampler(plist, ["a", "b"], routing="named", default_teacher=None, batch_size=2, seed=0)


def test_teachers_score_their_rows_all_averages_and_prompt_tokens_are_masked(ckpts):
    tok = K3Tokenizer.from_file(ckpts / "student" / "final")
    teachers = [load_model(ckpts / n)[0] for n in ("a", "b")]
    student = load_model(ckpts / "student" / "final")[0]
    plist = read_prompts(ckpts / "prompts.jsonl", tok, ["a", "b"], context=256, max_new_tokens=8)
    sampler = PromptSampler(plist, ["a", "b"], routing="all", default_teacher=None, batch_size=6, seed=3)
    completions = [[5, 6, 7], [8], [9, 10]]

    def fake_generate(model, tok, prompts, **kw):
        return [completions[i % 3] for i in range(len(prompts))]

    dcfg = _cfg().distill
    b = next(DistillBatches(sampler, student, teachers, tok, dcfg, fake_generate, torch.device("cpu")))
    prompts, routes, _, _ = next(PromptSampler(plist, ["a", "b"], routing="all", default_teacher=None,
                                               batch_size=6, seed=3))
    assert b.routes_B == routes and ALL in routes and 0 in routes
    for i, (p, r) in enumerate(zip(prompts, routes)):
        c = completions[i % 3]
        n = len(p.ids) + len(c)
        assert b.tokens_BT1[i, :n].tolist() == list(p.ids) + c
        assert b.mask_BT[i].nonzero()[:, 0].tolist() == list(range(len(p.ids) - 1, n - 1))  # completion targets only
        row = b.tokens_BT1[i:i + 1, :n - 1]
        with torch.no_grad():
            each = [F.log_softmax(t(row).logits.float(), -1)[0] for t in teachers]
        ref = F.log_softmax((each[0] + each[1]) / 2, -1) if r == ALL else each[r]
        torch.testing.assert_close(b.teacher_logp_BTV[i, :n - 1], ref, rtol=1e-4, atol=1e-4)


def test_batched_generation_at_temperature_zero_equals_k3_generate(ckpts):
    model, _ = load_model(ckpts / "student" / "final")
    tok = K3Tokenizer.from_file(ckpts / "student" / "final")
    prompts = [tok.encode(t, add_bos=True) for t in ("def add(a, b):", "import os\n", "class Foo:\n    ")]
    batched = generate_batch(model, tok, prompts, max_tokens=12, temperature=0.0, seeds=[1, 2, 3])
    for p, out in zip(prompts, batched):
        single = [t for ev in stream_text(model, tok, p, max_tokens=12, temperature=0.0) for t in ev.token_ids]
        assert out == single
    sampled = generate_batch(model, tok, prompts, max_tokens=12, temperature=1.0, seeds=[1, 2, 3])
    assert sampled == generate_batch(model, tok, prompts, max_tokens=12, temperature=1.0, seeds=[1, 2, 3])


def _losses(run_dir):
    return [(r["step"], r["loss"], r["reverse_kl"]) for r in map(json.loads, (run_dir / "metrics.jsonl").open())
            if "loss" in r]


def test_sigterm_then_resume_reproduces_the_uninterrupted_losses(ckpts, tmp_path, monkeypatch):
    full = _run(ckpts, tmp_path / "full")
    assert full.final_dir is not None and (full.final_dir / "model.safetensors").is_file()
    rec = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reverse_kl/a", "student_logprob/a", "teacher_logprob/a", "sample_len/a", "gen_tokens_per_s",
                "tokens_per_s"):
        assert key in rec
    real = loop_mod.lr_at

    def lr_at_with_sigterm(step, cfg, max_steps):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step 4: the loop finishes it, saves, returns
        return real(step, cfg, max_steps)

    monkeypatch.setattr(loop_mod, "lr_at", lr_at_with_sigterm)
    first = _run(ckpts, tmp_path / "split")
    assert first.final_dir is None and first.step == 4 and first.stop_signal == signal.SIGTERM
    monkeypatch.setattr(loop_mod, "lr_at", real)
    second = _run(ckpts, tmp_path / "split", resume=True)
    assert second.step == 6
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full")  # bit-exact on CPU
    assert full.final_dir.exists()


def _cli(ckpts, out, *args, prompts=None):
    return CliRunner().invoke(app, ["distill", "--student", str(ckpts / "student" / "final"), "--teacher",
                                    f"a={ckpts / 'a'}", "--prompts", str(prompts or ckpts / "prompts.jsonl"),
                                    "--out", str(out), "--set", "distill.default_teacher=a", "--set",
                                    "distill.max_new_tokens=8", *args])


def test_errors_exit_2_before_any_work_with_nothing_written(ckpts, tmp_path):
    out = tmp_path / "out"
    # a teacher of another vocabulary: both sizes and both tokenizer files named
    other = tmp_path / "other"
    tok = train_bpe(["def f(x):\n    return x\n" * 50, "import os\nprint(os)\n" * 50], vocab_size=300)
    tok.save(tmp_path / "tok")
    cfg, _ = load_release(ckpts / "a")
    cfg.vocab_size = 320
    save_release(other, build_model(cfg).state_dict(), cfg, tokenizer_dir=tmp_path / "tok")
    r = CliRunner().invoke(app, ["distill", "--student", str(ckpts / "student" / "final"), "--teacher",
                                 f"x={other}", "--prompts", str(ckpts / "prompts.jsonl"), "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "vocab_size 320 and 285 tokens" in r.output and "student vocab_size 512 and 512 tokens" in r.output
    assert str(other / "tokenizer.json") in r.output.replace("\n", "")
    # a teacher name no --teacher defines: the line is named
    r = _cli(ckpts, out)  # line 2 routes to b, only a is given
    assert r.exit_code == 2 and "prompts.jsonl:2: teacher 'b' is not defined" in r.output.replace("\n", "")
    # a prompt longer than the context
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x = 1\n" * 400}) + "\n")
    r = _cli(ckpts, out, prompts=long)
    assert r.exit_code == 2 and "long.jsonl:1" in r.output and "context of" in r.output.replace("\n", " ")
    r = _cli(ckpts, out, "--set", "distill.loss=kl")
    assert r.exit_code == 2 and "distill.loss" in r.output
    r = CliRunner().invoke(app, ["distill", "--student", str(ckpts / "student" / "final"), "--teacher", "a",
                                 "--prompts", str(long), "--out", str(out)])
    assert r.exit_code == 2 and "NAME=CKPT" in r.output
    assert not out.exists()


def test_batched_generation_has_no_request_time_limit(ckpts, monkeypatch):
    # many queued prompts on a slow CPU may take longer than a server request may: nothing is aborted
    import k3.serve.engine as engine_mod

    clock = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(engine_mod.time, "monotonic", lambda: float(next(clock)))
    model, _ = load_model(ckpts / "student" / "final")
    tok = K3Tokenizer.from_file(ckpts / "student" / "final")
    outs = generate_batch(model, tok, [tok.encode("def f(", add_bos=True)] * 3, max_tokens=4, max_num_seqs=1)
    assert all(len(o) >= 1 for o in outs)
