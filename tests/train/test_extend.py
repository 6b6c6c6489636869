"""`k3 extend-context` and `k3 eval` on the debug preset: rope -> nope keeps every tensor, a nope model's prefill +
decode equals its full forward, the passkey generator and scorer, SIGTERM + --resume bit-exact, loss buckets that sum
to the loss, and every refusal (exit 2, nothing written)."""

import json
import os
import re
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import k3.train.loop as loop_mod
from k3.cli.config import config_dict, resolve_config
from k3.cli.main import app
from k3.model.checkpoint import load_model, load_state_into, trained_seq_len
from k3.model.tokenizer import K3Tokenizer
from k3.model.transformer import build_model
from k3.serve.generate import generate_batch
from k3.train.data import BatchLoader, PasskeyMixLoader
from k3.train.evaluate import eval_data, loss_eval, passkey_eval, position_buckets
from k3.train.extend import model_overrides
from k3.train.extend import run as extend_run
from k3.train.passkey import NEEDLE, make_passkey_doc, passkey_correct
from k3.train.pretrain import run as pretrain_run
from k3.train.quantize import quantize_release

FAST = ["data.max_bytes=400000", "data.tokenizer_sample_bytes=200000", "train.batch_size=4", "train.log_every=1",
        "train.eval_every=0", "train.eval_batches=2", "ckpt.every=0", "train.threads=1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3cache"))


@pytest.fixture(scope="module")
def parent(tmp_path_factory, cache_dir):
    """A debug release trained 6 steps at 64 tokens with RoPE."""
    out = tmp_path_factory.mktemp("parent") / "run"
    cfg = resolve_config("pretrain", preset="debug", sets=[f"data.cache_dir={cache_dir}", *FAST, "train.max_steps=6"])
    return pretrain_run(cfg, run_dir=out, run_config={"config": config_dict(cfg)}).final_dir  # as k3 pretrain


def _extend_cfg(parent, cache_dir, *sets, position="nope", rope_theta=None, seq_len=128):
    return resolve_config("extend-context", preset="tiny", overrides={
        "model": model_overrides(parent, position=position, rope_theta=rope_theta), "data": {"seq_len": seq_len}},
        sets=[f"data.cache_dir={cache_dir}", *FAST, "train.max_steps=10", "optim.warmup_steps=2",
              "data.passkey_fraction=0.5", *sets])


def _losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_rope_to_nope_keeps_every_name_and_shape_and_loads_strictly():
    cfg = resolve_config("pretrain", preset="debug").model
    rope = build_model(cfg, seed=0)
    nope = build_model(type(cfg).from_dict({**cfg.to_dict(), "mla_position": "nope"}), seed=1)
    a, b = rope.state_dict(), nope.state_dict()
    assert [(k, v.shape) for k, v in a.items()] == [(k, v.shape) for k, v in b.items()]
    load_state_into(nope, a)  # strict: missing or unexpected names raise
    assert all(torch.equal(nope.state_dict()[k], v) for k, v in a.items())
    tokens = torch.randint(0, cfg.vocab_size, (1, 40))
    assert not torch.allclose(rope(tokens).logits, nope(tokens).logits)  # the mode is live, not ignored


def test_nope_prefill_and_decode_equal_the_full_forward_token_by_token():
    cfg = resolve_config("pretrain", preset="debug").model
    model = build_model(type(cfg).from_dict({**cfg.to_dict(), "mla_position": "nope"}), seed=3).eval()
    with torch.no_grad():  # pseudo-queries start at 0; perturb them so AttnRes mixes depth non-uniformly
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 90))
    with torch.no_grad():
        full = model(tokens).logits  # [2, 90, V]
        state = model.new_state(2)
        steps = [model(tokens[:, :70], state=state).logits]  # prefill crosses a 64-token KDA chunk
        steps += [model(tokens[:, t:t + 1], state=state).logits for t in range(70, 90)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_passkey_documents_are_deterministic_and_place_the_key_at_the_depth(parent):
    tok = K3Tokenizer.from_file(parent)
    filler = np.arange(100, 400).repeat(20) % tok.vocab_size  # 6,000 ids
    for depth in (0.0, 0.3, 1.0):
        a = make_passkey_doc(tok, filler, 256, depth, np.random.default_rng([7, 1]))
        b = make_passkey_doc(tok, filler, 256, depth, np.random.default_rng([7, 1]))
        assert a == b and len(a.tokens) == 256 and a.tokens[0] == tok.eos_id
        needle = tok.encode(NEEDLE.format(key=a.key), parse_special=False)
        assert a.tokens[a.key_start:a.key_start + len(needle)] == needle
        n_filler = 256 - 1 - len(needle) - len(tok.encode("\n# What is the pass key? The pass key is"))
        assert a.key_start - 1 == round(depth * n_filler)
        assert tok.decode(a.tokens).endswith("# What is the pass key? The pass key is")
    other = make_passkey_doc(tok, filler, 256, 0.5, np.random.default_rng([8, 1]))
    assert other.key != a.key or other.tokens != a.tokens
    train_doc = make_passkey_doc(tok, filler, 129, 0.5, np.random.default_rng(0), with_answer=True)
    assert len(train_doc.tokens) == 129 and tok.decode(train_doc.tokens).endswith(f"is {train_doc.key}\n")


def test_the_training_mix_packs_whole_passkey_documents_deterministically(parent):
    tok = K3Tokenizer.from_file(parent)
    data = eval_data(parent, tok.vocab_size)
    loaders = [PasskeyMixLoader(BatchLoader(data.train, batch_size=4, seq_len=256, seed=1), tok, 0.5, seed=3)
               for _ in range(2)]
    a, b = ([next(lo) for _ in range(3)] for lo in loaders)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    plain = [next(lo) for lo in [BatchLoader(data.train, batch_size=4, seq_len=256, seed=1)] for _ in range(3)]
    mixed = [(t, row) for (t, _), (p, _) in zip(a, plain) for row in range(4) if not torch.equal(t[row], p[row])]
    assert 0 < len(mixed) < 12  # about half the rows
    for t, row in mixed:
        text = tok.decode(t[row].tolist())
        n_docs = text.count("# What is the pass key? The pass key is")
        assert n_docs >= 1 and text.count(" is the pass key.\n") == n_docs  # whole documents only
        needles = re.findall(r"# The pass key is (\d{5})\. Remember it\.", text)
        answers = re.findall(r"# What is the pass key\? The pass key is (\d{5})\n", text)
        assert needles == answers and len(answers) == n_docs  # each answer is its own document's key


def test_scorer_counts_exact_matches_only(parent):
    assert passkey_correct(" 48213", "48213") and passkey_correct("48213.\n#", "48213")
    for wrong in (" 482130", " 4821", "# 48213", " The pass key is 48213", "", " 48214"):
        assert not passkey_correct(wrong, "48213"), wrong
    tok = K3Tokenizer.from_file(parent)
    filler = np.asarray(tok.encode("def f(x):\n    return x + 1\n\n" * 300))
    kw = {"lengths": [128, 256], "depths": [0.0, 0.5, 1.0], "trials": 3, "seed": 0}
    echo = passkey_eval(tok, filler, lambda prompts, n, cb: [p[1:1 + n] for p in prompts], **kw)
    assert echo["overall"] == 0.0  # echoing the filler never scores
    keys = {}

    def oracle(prompts, n, cb):  # reads the key back out of the needle: every prompt must score
        out = []
        for p in prompts:
            text = tok.decode(p)
            keys[len(keys)] = key = text.split("The pass key is ")[1][:5]
            out.append(tok.encode(f" {key}\n"))
        return out

    assert passkey_eval(tok, filler, oracle, **kw)["overall"] == 1.0


def test_passkey_through_the_engine_writes_a_grid(parent):
    model, _ = load_model(parent)
    tok = K3Tokenizer.from_file(parent)
    data = eval_data(parent, model.config.vocab_size)
    res = passkey_eval(tok, data.val.tokens, lambda p, n, cb: generate_batch(model, tok, p, max_tokens=n,
                                                                             on_finish=cb),
                       lengths=[96, 160], depths=[0.0, 1.0], trials=2, seed=0)
    assert np.asarray(res["accuracy"]).shape == (2, 2) and len(res["results"]) == 8
    assert all(0.0 <= a <= 1.0 for row in res["accuracy"] for a in row)


def test_loss_buckets_sum_to_the_overall_loss(parent):
    model, _ = load_model(parent)
    data = eval_data(parent, model.config.vocab_size)
    res = loss_eval(model, data, seq_len=100, batches=2, batch_size=3)
    assert [(b["start"], b["end"]) for b in res["buckets"]] == position_buckets(100) == [
        (0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 100)]
    weighted = sum(b["loss"] * b["tokens"] for b in res["buckets"]) / sum(b["tokens"] for b in res["buckets"])
    assert weighted == pytest.approx(res["loss"], rel=1e-12)
    # an independent float64 reference over the same windows
    T, ref, n = 100, 0.0, 0
    for i in range(6):
        w = torch.from_numpy(np.asarray(data.val.tokens[i * T:i * T + T + 1], dtype=np.int64))[None]
        with torch.no_grad():
            logits = model(w[:, :-1]).logits.double()
        ref += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
        n += T
    assert res["tokens"] == n and res["loss"] == pytest.approx(ref / n, rel=1e-6)
    assert res["bpb"] == pytest.approx(res["loss"] / np.log(2) / data.meta["val_bytes_per_token"])


def test_extend_sigterm_then_resume_reproduces_the_uninterrupted_losses(parent, cache_dir, tmp_path, monkeypatch):
    full = extend_run(_extend_cfg(parent, cache_dir), ckpt=parent, run_dir=tmp_path / "full")
    cfg = json.loads((full.final_dir / "config.json").read_text())
    assert cfg["mla_position"] == "nope" and cfg["max_position_embeddings"] == 128
    assert trained_seq_len(full.final_dir) == 128
    run_yaml = (full.final_dir / "k3_run.yaml").read_text()
    assert f"parent_checkpoint: {parent}" in run_yaml
    real_lr_at = loop_mod.lr_at

    def lr_at_with_sigterm(step, cfg, max_steps):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the loop finishes step 5, saves, returns
        return real_lr_at(step, cfg, max_steps)

    monkeypatch.setattr(loop_mod, "lr_at", lr_at_with_sigterm)
    first = extend_run(_extend_cfg(parent, cache_dir), ckpt=parent, run_dir=tmp_path / "split")
    assert first.final_dir is None and first.step == 5 and first.stop_signal == signal.SIGTERM
    monkeypatch.setattr(loop_mod, "lr_at", real_lr_at)
    second = extend_run(_extend_cfg(parent, cache_dir), ckpt=parent, run_dir=tmp_path / "split", resume=True)
    assert second.step == 10
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full")  # bit-exact on CPU, passkey mix included
    assert second.val_loss == full.val_loss


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_every_refusal_exits_2_and_writes_nothing(parent, cache_dir, tmp_path):
    sets = [a for s in [f"data.cache_dir={cache_dir}", *FAST, "train.max_steps=8", "optim.warmup_steps=2"]
            for a in ("--set", s)]
    out = tmp_path / "child"
    r = _cli("extend-context", parent, "--seq-len", 64, "--out", out, *sets)
    assert r.exit_code == 2 and "not above the 64 tokens" in r.output and not out.exists()
    r = _cli("extend-context", parent, "--seq-len", 128, "--position", "nope", "--rope-theta", 4e4, "--out", out)
    assert r.exit_code == 2 and "--position rope" in r.output and not out.exists()
    r = _cli("extend-context", parent, "--seq-len", 128, "--position", "alibi", "--out", out)
    assert r.exit_code == 2 and "nope (the K3 recipe) or rope" in r.output and not out.exists()
    q = quantize_release(parent, tmp_path / "parent-w4a8")
    r = _cli("extend-context", q, "--seq-len", 128, "--out", out, *sets)
    assert r.exit_code == 2 and "quantized release (w4a8)" in r.output and not out.exists()
    # a nope child refuses --position nope unless the mode is forced with --set
    r = _cli("extend-context", parent, "--seq-len", 96, "--out", tmp_path / "nope", *sets)
    assert r.exit_code == 0, r.output
    nope = tmp_path / "nope" / "final"
    r = _cli("extend-context", nope, "--seq-len", 128, "--out", out, *sets)
    assert r.exit_code == 2 and "already nope" in r.output and "--set model.mla_position=nope" in r.output
    assert not out.exists()
    r = _cli("extend-context", nope, "--seq-len", 128, "--out", out, *sets, "--set", "model.mla_position=nope")
    assert r.exit_code == 0, r.output
    # k3 eval loss works on the quantized release
    r = _cli("eval", "loss", q, "--seq-len", 64, "--batches", 1, "--out", tmp_path / "qeval", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "qeval" / "loss.json").read_text())["quantization"] == "w4a8"
    assert (tmp_path / "qeval" / "loss.png").stat().st_size > 1000


def test_rope_child_of_a_training_checkpoint_and_the_eval_passkey_command(parent, cache_dir, tmp_path):
    step_dir = max((parent.parent / "checkpoints").iterdir())  # RUN_DIR/checkpoints/step-N: also a parent
    child = extend_run(_extend_cfg(step_dir, cache_dir, "train.max_steps=3", position="rope", rope_theta=40000.0),
                       ckpt=step_dir, run_dir=tmp_path / "rope").final_dir
    cfg = json.loads((child / "config.json").read_text())
    assert cfg["mla_position"] == "rope" and cfg["rope_theta"] == 40000.0 and cfg["max_position_embeddings"] == 128
    assert f"parent_checkpoint: {step_dir}" in (child / "k3_run.yaml").read_text()
    r = _cli("eval", "passkey", child, "--lengths", "96,128", "--depths", "0,1", "--trials", 2, "--out",
             tmp_path / "ev", "--device", "cpu")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "ev" / "passkey.json").read_text())
    assert res["lengths"] == [96, 128] and res["depths"] == [0.0, 1.0] and res["mla_position"] == "rope"
    assert (tmp_path / "ev" / "passkey.png").stat().st_size > 1000
    r = _cli("eval", "passkey", child, "--depths", "0,2", "--out", tmp_path / "bad")
    assert r.exit_code == 2 and not (tmp_path / "bad").exists()
