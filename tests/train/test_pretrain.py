"""`k3 pretrain` end to end on the debug preset: loss falls, exact resume, signals, NaN stop, --init,
generate == argmax of the full forward, MTP lambda = 0 trains bit-identically to no MTP, readable config errors."""

import json
import os
import signal

import pytest
import torch
from typer.testing import CliRunner

import k3.train.loop as loop_mod
from k3.cli.config import resolve_config
from k3.cli.main import app
from k3.model.checkpoint import load_model
from k3.model.tokenizer import K3Tokenizer
from k3.serve.generate import generate_tokens
from k3.train.loop import TrainingError
from k3.train.pretrain import run


def _losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r], lines


def test_debug_end_to_end(tmp_path, debug_cfg):
    cfg = debug_cfg("train.max_steps=40", "train.batch_size=8")
    res = run(cfg, run_dir=tmp_path / "run")
    losses, lines = _losses(tmp_path / "run")
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # it learns
    rec = next(r for r in lines if "loss" in r)
    for key in ("step", "loss", "lr", "tokens", "tokens_per_s", "router_max_violation", "max_attn_logit"):
        assert key in rec
    evals = [r for r in lines if "val_loss" in r]
    assert evals and "val_bpb" in evals[-1]
    assert res.val_loss == pytest.approx(evals[-1]["val_loss"])
    final = tmp_path / "run" / "final"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "k3_run.yaml"):
        assert (final / f).is_file(), f
    assert (tmp_path / "run" / "run_config.yaml").is_file()
    assert any((tmp_path / "run" / "checkpoints").iterdir())


def test_resume_reproduces_uninterrupted_losses(tmp_path, debug_cfg, monkeypatch):
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    run(debug_cfg("train.max_steps=12"), run_dir=full_dir)
    full, _ = _losses(full_dir)

    real_lr_at = loop_mod.lr_at

    def lr_at_with_sigterm(step, cfg, max_steps):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step; the loop finishes step 6, saves, returns
        return real_lr_at(step, cfg, max_steps)

    monkeypatch.setattr(loop_mod, "lr_at", lr_at_with_sigterm)
    first = run(debug_cfg("train.max_steps=12"), run_dir=split_dir)
    assert first.final_dir is None and first.step == 6 and first.stop_signal == signal.SIGTERM
    monkeypatch.setattr(loop_mod, "lr_at", real_lr_at)
    second = run(debug_cfg("train.max_steps=12"), run_dir=split_dir, resume=True)
    assert second.step == 12
    split, _ = _losses(split_dir)
    assert split == full  # bit-exact on CPU
    assert second.val_loss == _losses(full_dir)[1][-1]["val_loss"]


def test_nan_loss_stops_with_message(tmp_path, debug_cfg, monkeypatch):
    real = loop_mod.lm_losses
    calls = {"n": 0}

    def poisoned(model, tokens, mask, with_mtp=True, **kw):
        out = real(model, tokens, mask, with_mtp, **kw)
        calls["n"] += 1
        if calls["n"] == 4:
            out["ce"] = out["ce"] * float("nan")
        return out

    monkeypatch.setattr(loop_mod, "lm_losses", poisoned)
    with pytest.raises(TrainingError, match=r"non-finite loss .* at step 4; the last good checkpoint is .*step-0000002"):
        run(debug_cfg("train.max_steps=10", "ckpt.every=2"), run_dir=tmp_path / "run")


def test_generate_equals_argmax_of_full_forward(tmp_path, debug_cfg):
    run(debug_cfg("train.max_steps=5"), run_dir=tmp_path / "run")
    model, _ = load_model(tmp_path / "run" / "final")
    tok = K3Tokenizer.from_file(tmp_path / "run" / "final")
    prompt = tok.encode("def main(", add_bos=True)
    got = list(generate_tokens(model, prompt, max_tokens=10, temperature=0))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_mtp_lambda_zero_trains_like_no_mtp(tmp_path, debug_cfg):
    a = run(debug_cfg("train.max_steps=6", "optim.mtp_lambda=0", "optim.mtp_lambda_late=0"),
            run_dir=tmp_path / "mtp")
    b = run(debug_cfg("train.max_steps=6", "model.mtp_depth=0"), run_dir=tmp_path / "nomtp")
    assert _losses(tmp_path / "mtp")[0] == _losses(tmp_path / "nomtp")[0]
    assert a.val_loss == b.val_loss


def test_init_from_checkpoint_and_architecture_mismatch(tmp_path, debug_cfg):
    run(debug_cfg("train.max_steps=8"), run_dir=tmp_path / "a")
    res = run(debug_cfg("train.max_steps=2"), run_dir=tmp_path / "b", init=str(tmp_path / "a" / "final"))
    fresh = run(debug_cfg("train.max_steps=2"), run_dir=tmp_path / "c")
    assert res.val_loss < fresh.val_loss  # it started from the trained weights
    from k3.model.config import ConfigError

    with pytest.raises(ConfigError, match="architecture differs.*d_model"):
        run(debug_cfg("train.max_steps=2", "model.d_model=96"), run_dir=tmp_path / "d",
            init=str(tmp_path / "a" / "final"))


def test_run_dir_guards(tmp_path, debug_cfg):
    from k3.model.checkpoint import CheckpointError
    from k3.model.config import ConfigError

    with pytest.raises(CheckpointError, match="no training checkpoint"):
        run(debug_cfg("train.max_steps=2"), run_dir=tmp_path / "empty", resume=True)
    run(debug_cfg("train.max_steps=2"), run_dir=tmp_path / "done")
    with pytest.raises(ConfigError, match="already holds a run.*--resume"):
        run(debug_cfg("train.max_steps=2"), run_dir=tmp_path / "done")


def test_cli_config_errors_are_readable(tmp_path):
    r = CliRunner().invoke(app, ["pretrain", "--preset", "debug", "--set", "train.max_step=3", "--out",
                                 str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "did you mean max_steps" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["pretrain", "--preset", "nosuch", "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "unknown pretrain preset 'nosuch'" in r.output
    r = CliRunner().invoke(app, ["pretrain", "--set", "data.source=/no/such/dir/*.txt", "--preset", "debug",
                                 "--out", str(tmp_path / "z")])
    assert r.exit_code == 2 and "/no/such/dir" in r.output


def test_cli_help_lists_commands():
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("pretrain", "generate", "scaling-fit"):
        assert cmd in r.output


def test_flops_per_token_and_mfu_logging(tmp_path, debug_cfg):
    from k3.cli.config import load_model_config
    from k3.model.transformer import K3Model, count_parameters
    from k3.train.pretrain import training_flops_per_token

    cfg = load_model_config("k3-small")
    with torch.device("meta"):
        counts = count_parameters(K3Model(cfg))
    f = training_flops_per_token(cfg, counts, 4096)
    # independent count: 6 x (non-embedding active + MTP + head twice) + causal attention of 4 MLA + 1 MTP layers
    head = 768 * 32768
    expected = 6 * (counts["active"] - head + counts["mtp"] + head) + 6 * 5 * 6 * (192 + 128) * 4096 / 2
    assert f == pytest.approx(expected)
    dbg = debug_cfg("train.max_steps=2", "train.peak_tflops=0.1")
    run(dbg, run_dir=tmp_path / "run")
    _, lines = _losses(tmp_path / "run")
    rec = [r for r in lines if "loss" in r][-1]
    with torch.device("meta"):
        dcounts = count_parameters(K3Model(dbg.model))
    f_dbg = training_flops_per_token(dbg.model, dcounts, dbg.data.seq_len)
    assert rec["mfu"] == pytest.approx(rec["tokens_per_s"] * f_dbg / 1e11)


def test_a_validation_split_too_short_fails_before_training(tmp_path, debug_cfg):
    from k3.train.data import DataError

    with pytest.raises(DataError, match="the val split has 0 tokens"):
        run(debug_cfg("train.max_steps=5", "data.val_fraction=0"), run_dir=tmp_path / "runs" / "run")
    assert not (tmp_path / "runs").exists()  # a start that failed leaves no directory behind


def test_a_training_error_with_brackets_is_printed_as_text(monkeypatch):
    """A collective's message names its source as "[/path/file.cc:129]": printed through rich it must stay text (it
    was read as a closing tag: MarkupError instead of the message and exit code 2)."""
    import io
    import types

    from rich.console import Console

    from k3.train.pretrain import fit_with_progress

    msg = "rank 0: lost rank 1 ([/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out)"

    def fit(progress=None):
        raise TrainingError(msg)

    trainer = types.SimpleNamespace(fit=fit, state=types.SimpleNamespace(step=0, tokens=0))
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=300)
    tcfg = resolve_config("pretrain", preset="debug").train
    with pytest.raises(TrainingError, match="unbound_buffer"):
        fit_with_progress(trainer, tcfg, console, resume=False, header="h", command="k3 pretrain")
    assert "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129]" in out.getvalue()
