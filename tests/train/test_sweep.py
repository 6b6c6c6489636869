"""k3.train.sweep: size parsing, K3-shaped model derivation hits its target N, the plan's --set lists reproduce the
derived models, and a 2x2 debug grid runs end to end (interrupted run resumed, finished runs skipped, runs.csv read by
k3.train.scaling.read_points)."""

import csv
import io
import math
import os
import signal

import pytest
import torch
from rich.console import Console

import k3.train.loop as loop_mod
from k3.cli.config import load_model_config, resolve_config
from k3.model.transformer import K3Model, count_parameters
from k3.train.scaling import read_points
from k3.train.sweep import (
    SweepError,
    count_model,
    derive_model,
    estimate_n,
    format_size,
    mla_layout,
    parse_list,
    parse_ratio,
    parse_size,
    per_layer_counts,
    plan_sweep,
    run_sweep,
    size_model,
)

TOL = 0.10  # the documented default: N within 10% of the target wherever the family has such a model


def resolver(preset="debug"):
    return lambda sets: resolve_config("pretrain", preset=preset, sets=sets)


@pytest.mark.parametrize("text, value", [("50k", 5e4), ("1.5M", 1.5e6), ("2e5", 2e5), ("3B", 3e9), ("7 K", 7e3),
                                         ("120", 120.0), (".5m", 5e5)])
def test_parse_size(text, value):
    assert parse_size(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "abc", "5x", "-5k", "0", "1.5MM", "k"])
def test_parse_size_rejects(text):
    with pytest.raises(SweepError, match="--sizes"):
        parse_size(text)


def test_parse_lists_and_ratios():
    assert parse_list("25k, 50k,100k", "--sizes", parse_size) == [25e3, 50e3, 100e3]
    assert parse_list("0.5,2,20", "--tokens-per-param", parse_ratio) == [0.5, 2.0, 20.0]
    for bad in ("0", "-1", "nan", "inf", "two"):
        with pytest.raises(SweepError, match="--tokens-per-param"):
            parse_ratio(bad)
    with pytest.raises(SweepError, match="repeated"):
        parse_list("50k,50000", "--sizes", parse_size)
    with pytest.raises(SweepError, match="no values"):
        parse_list(" , ", "--sizes", parse_size)
    assert format_size(5e4) == "50k" and format_size(1.5e6) == "1.5M" and format_size(999) == "999"


def test_mla_layout_matches_k3():
    assert mla_layout(4) == [4] and mla_layout(8) == [4, 8] and mla_layout(6) == [4, 6]
    assert mla_layout(2) == [2] and mla_layout(3) == [3]
    k3 = mla_layout(93)  # the reported K3 layout: 4, 8, ..., 92 and the last layer 93 (architecture.md 1)
    assert k3 == list(range(4, 93, 4)) + [93] and len(k3) == 24 and 93 - len(k3) == 69


def _check_k3_shape(m, base):
    assert m.full_attn_layers == mla_layout(m.n_layers)
    types = m.layer_types
    assert types[0] == "kda" and m.mlp_types[0] == "dense" and set(m.mlp_types[1:]) == {"moe"}
    assert types.count("kda") >= 3 * types.count("mla") - 3  # ~3:1, the extra MLA of a non-multiple-of-4 depth
    assert m.moe_latent_size * 2 == m.d_model  # l = d/2
    assert m.num_attnres_sources - 1 <= 8 and m.attn_res_block_size == math.ceil(m.n_layers / 8)
    assert m.kda_num_heads * m.kda_head_dim == m.d_model  # the presets' H * d_k = d is kept
    for f in ("vocab_size", "num_experts", "num_experts_per_tok", "num_shared_experts", "kda_head_dim",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_act", "mtp_depth"):
        assert getattr(m, f) == getattr(base, f), f
    m.validate()


@pytest.mark.parametrize("preset, targets", [("k3-debug", [5e4, 1e5, 2e5, 4e5, 1e6]),
                                             ("k3-tiny", [2e6, 8e6])])
def test_derived_models_hit_target_and_keep_k3_shape(preset, targets):
    base = load_model_config(preset)
    for target in targets:
        sm = size_model(base, target)
        assert abs(sm.rel_err) <= TOL, (target, sm.N)
        _check_k3_shape(sm.model, base)
        with torch.device("meta"):  # the reported N is count_parameters of the model itself
            assert sm.N == count_parameters(K3Model(sm.model))["active_nonembed"]


def test_total_params_mode_and_base_preset_recovered():
    base = load_model_config("k3-debug")
    # the preset itself is in the family (L=4, d=64) and has the preset's aspect ratio: its own N selects it
    n_debug = count_model(base)["active_nonembed"]
    sm = size_model(base, n_debug)
    assert (sm.model.n_layers, sm.model.d_model, sm.N) == (4, 64, n_debug)
    tot = size_model(base, 3e5, params="total")
    assert tot.N == tot.counts["total_nonembed"] and abs(tot.rel_err) <= TOL
    assert tot.counts["active_nonembed"] < tot.N


def test_per_layer_estimate_equals_exact_count():
    base = load_model_config("k3-debug")
    for d in (32, 96):
        parts = per_layer_counts(base, d, "active_nonembed")
        for L in (2, 3, 7, 9, 12):
            assert estimate_n(*parts, L) == count_model(derive_model(base, L, d))["active_nonembed"], (d, L)


def test_size_errors():
    base = load_model_config("k3-debug")
    with pytest.raises(SweepError, match="below the smallest model"):
        size_model(base, 2e3)
    with pytest.raises(SweepError, match="same model"):
        plan_sweep(resolver(), preset="debug", sizes=[5e4, 5.1e4], ratios=[1], sets=[], out="x")
    with pytest.raises(SweepError, match="train.max_steps"):
        plan_sweep(resolver(), preset="debug", sizes=[5e4], ratios=[1], sets=["train.max_steps=3"], out="x")
    with pytest.raises(SweepError, match="full_attn_layers"):
        plan_sweep(resolver(), preset="debug", sizes=[5e4], ratios=[1], sets=["model.full_attn_layers=[2]"], out="x")


def test_plan_steps_and_sets_reproduce_models(tmp_path):
    sets = ["train.batch_size=8", "model.moe_intermediate_size=64"]  # model.* edits the base the sizes scale from
    plan = plan_sweep(resolver(), preset="debug", sizes=[1e5, 5e4], ratios=[20, 2.5], sets=sets, out=tmp_path)
    assert [p.name for p in plan.points] == ["50k-2.5", "50k-20", "100k-2.5", "100k-20"]
    assert not tmp_path.joinpath("runs").exists()  # planning writes nothing
    for p in plan.points:
        assert p.tokens_per_step == 8 * 64  # batch 8 x debug seq_len 64
        assert p.max_steps == math.ceil(p.ratio * p.sized.N / p.tokens_per_step)
        cfg = resolve_config("pretrain", preset="debug", sets=p.sets)
        assert cfg.model == p.sized.model and cfg.train.max_steps == p.max_steps and cfg.train.batch_size == 8
        assert count_model(cfg.model)["active_nonembed"] == p.sized.N
        assert cfg.model.moe_intermediate_size == max(8, 8 * round(64 * cfg.model.d_model / 64 / 8))


def test_debug_grid_end_to_end_resume_and_skip(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    sets = [f"data.cache_dir={cache}", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
            "data.seq_len=32", "train.batch_size=8", "train.eval_every=0", "train.eval_batches=2", "ckpt.every=0",
            "train.threads=1", "train.log_every=5"]
    out = tmp_path / "sweep"
    plan = plan_sweep(resolver(), preset="debug", sizes=[25e3, 5e4], ratios=[0.1, 0.2], sets=sets, out=out)
    assert [p.max_steps for p in plan.points] == [10, 19, 20, 40]
    quiet = Console(file=io.StringIO())

    # 1st call: SIGTERM during the second run (the train loop checkpoints and stops; the sweep stops there)
    real_lr_at, calls = loop_mod.lr_at, {"n": 0}

    def lr_at_with_sigterm(step, cfg, max_steps):
        calls["n"] += 1
        if calls["n"] == 10 + 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_lr_at(step, cfg, max_steps)

    monkeypatch.setattr(loop_mod, "lr_at", lr_at_with_sigterm)
    res1 = run_sweep(plan, resolver(), console=quiet)
    monkeypatch.setattr(loop_mod, "lr_at", real_lr_at)
    assert res1.ran == ["25k-0.1", "25k-0.2"] and res1.stopped == "25k-0.2" and len(res1.rows) == 1
    assert res1.stop_signal == signal.SIGTERM  # `k3 sweep` exits with 128 + it

    # 2nd call: finished run skipped, interrupted run resumed, the rest trained
    res2 = run_sweep(plan, resolver(), console=quiet)
    assert res2.skipped == ["25k-0.1"] and res2.ran == ["25k-0.2", "50k-0.1", "50k-0.2"] and res2.stopped is None
    assert res2.stop_signal is None
    pts = read_points([str(out / "runs.csv")])  # what `k3 scaling-fit OUT/runs.csv` reads
    assert len(pts.N) == 4
    with open(out / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r, p in zip(rows, plan.points):
        assert int(r["N"]) == p.sized.N and int(r["D"]) == p.max_steps * 8 * 32 and r["params_mode"] == "active"
        assert float(r["C"]) == pytest.approx(6 * p.sized.N * int(r["D"]), rel=1e-5)
        assert 0 < float(r["loss"]) < math.log(512) + 1
    dir_pts = read_points([str(out / "runs")])  # and the run directories give the same points
    assert sorted(dir_pts.N) == sorted(pts.N) and sorted(dir_pts.loss) == pytest.approx(sorted(pts.loss), abs=1e-6)

    # 3rd call: nothing left to train; runs.csv unchanged
    before = (out / "runs.csv").read_text()
    res3 = run_sweep(plan, resolver(), console=quiet)
    assert res3.ran == [] and len(res3.skipped) == 4 and (out / "runs.csv").read_text() == before

    # a changed config for the same directory is refused, not mixed in
    plan_lr = plan_sweep(resolver(), preset="debug", sizes=[25e3, 5e4], ratios=[0.1, 0.2],
                         sets=sets + ["optim.lr=0.02"], out=out)
    with pytest.raises(SweepError, match="different config.*optim.lr"):
        run_sweep(plan_lr, resolver(), console=quiet)
