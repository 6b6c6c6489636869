"""k3.train.ablate: the suites pair their arms (configs differ only in the stated overrides; equal tokens and seeds),
the runner skips finished runs, resumes interrupted ones and refuses a changed config (with pretrain.run stubbed),
the report holds the stubs' means / spreads, verdicts, plots and missing runs, the GLU recorder matches a direct
computation, the CLI lists and rejects suites, and one real debug-sized attnres suite runs end to end."""

import io
import json
import math
import shutil
import statistics
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

import k3.train.pretrain as pretrain_mod
from k3.cli.config import resolve_config
from k3.cli.main import app
from k3.model.config import ModelConfig
from k3.model.layers import GatedMLP
from k3.model.moe import GroupedExperts
from k3.model.transformer import build_model
from k3.train.ablate import AblateError, GluMaxRecorder, command_line, plan, resolve_run, run_suites
from k3.train.ablate_report import read_run, write_report
from k3.train.ablate_suites import SCALES, SUITES, Scale

runner = CliRunner()


def resolve(command, preset, sets, overrides):
    return resolve_config(command, preset=preset, sets=sets, overrides=overrides)


def quiet():
    return Console(file=io.StringIO(), width=200)


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------------------- pairing


@pytest.mark.parametrize("scale", ["tiny", "small"])
def test_arms_differ_only_in_their_overrides_with_equal_tokens_and_seeds(scale, tmp_path):
    sc = SCALES[scale]
    suites = [s for s in SUITES.values() if s.wired]
    runs = [r for r in plan(suites, sc, 2, tmp_path, resolve) if r.arm.command == "pretrain"]
    by_suite = {}
    for r in runs:
        cfg = resolve_run(r, sc, resolve)
        c = flat({k: v for k, v in yaml.safe_load(yaml.safe_dump({
            "model": cfg.model.to_dict(), "data": vars_of(cfg.data), "optim": vars_of(cfg.optim),
            "train": vars_of(cfg.train)})).items()})
        by_suite.setdefault(r.suite.name, {})[(r.arm.label, r.seed)] = (r, cfg, c)
    for name, arms in by_suite.items():
        items = list(arms.values())
        # arms that set their own step budget (the opd suite's teacher and student parent) are the exception
        budget = [(r, cfg) for r, cfg, _ in items if not any(s.startswith("train.max_steps=") for s in r.arm.sets)]
        tokens = {cfg.train.max_steps * cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len
                  for _, cfg in budget}
        assert len(tokens) <= 1 and (budget or name == "opd"), (name, tokens)
        assert {cfg.data.seed for _, cfg, _ in items} == {1234}
        for r, cfg, _ in items:
            assert cfg.train.seed == r.seed
        for r, cfg in budget:
            assert cfg.train.max_steps == sc.steps
        for ra, _, ca in items:
            for rb, _, cb in items:
                if ra.seed != rb.seed:
                    continue
                named = {s.split("=", 1)[0] for s in ra.arm.sets + rb.arm.sets}
                differ = {k for k in ca if ca[k] != cb.get(k)}
                assert differ <= named, (name, ra.arm.label, rb.arm.label, differ - named)
                if ra.arm.label != rb.arm.label:
                    assert differ, (name, ra.arm.label, rb.arm.label, "arms train the same config")
    # the qat suite: the bf16 fine-tune trains as QAT does (steps, optimizer, batch, length, seeds)
    qruns = {r.arm.label: r for r in plan([SUITES["qat"]], sc, 1, tmp_path, resolve)}
    assert list(qruns) == ["parent", "bf16-ft", "qat", "ptq"]  # parents first
    ft = resolve_config("pretrain", preset=sc.preset, sets=qruns["bf16-ft"].sets)
    qat = resolve_config("quantize", preset=sc.quantize_preset, sets=qruns["qat"].sets)
    assert qat.quantize.mode == "qat" and qat.quantize.data == ft.data.source == "stdlib"
    for sec, keys in (("optim", ("lr", "schedule", "warmup_steps", "min_lr_ratio", "optimizer")),
                      ("train", ("max_steps", "batch_size", "grad_accum", "seed")), ("data", ("seq_len", "seed"))):
        for k in keys:
            assert getattr(getattr(ft, sec), k) == getattr(getattr(qat, sec), k), (sec, k)
    # the nope children share every --set and differ only in the position they extend with
    kids = [r for r in plan([SUITES["nope"]], sc, 1, tmp_path, resolve) if r.arm.command == "extend-context"]
    assert len(kids) == 2 and kids[0].sets == kids[1].sets
    assert {k.arm.position for k in kids} == {"nope", "rope"} and {k.arm.parent for k in kids} == {"parent"}
    check_opd_pairing(sc, tmp_path)


def check_opd_pairing(sc, tmp_path):
    """The opd suite: teacher and student parent differ in their step budget only (the teacher trains longer); the
    opd (k3 distill) and sft (k3 pretrain --init on the teacher's samples) arms of a seed train the same student
    for the same optimizer steps, optimizer and schedule, prompts / sequences per step and seed, the sft sequence
    holding a prompt and a completion of the opd arm's lengths."""
    runs = {(r.arm.label, r.seed): r for r in plan([SUITES["opd"]], sc, 2, tmp_path, resolve)}
    order = [r.arm.label for r in plan([SUITES["opd"]], sc, 1, tmp_path, resolve)]
    assert order[:2] == ["teacher", "student"] and set(order[2:]) == {"opd", "sft"}  # teacher and parent first
    for seed in (0, 1):
        t, st = (resolve_run(runs[(a, seed)], sc, resolve) for a in ("teacher", "student"))
        assert t.train.max_steps == sc.opd_teacher_steps > st.train.max_steps == sc.opd_student_steps
        assert t.model == st.model and t.data == st.data and t.optim == st.optim
        assert t.train == replace(st.train, max_steps=t.train.max_steps) and t.train.seed == seed
        ropd, rsft = runs[("opd", seed)], runs[("sft", seed)]
        dist, sft = resolve_run(ropd, sc, resolve), resolve_run(rsft, sc, resolve)
        assert ropd.arm.command == "distill" and rsft.arm.command == "finetune"
        assert ropd.arm.parent == rsft.arm.parent == "student" and ropd.arm.teacher == rsft.arm.teacher == "teacher"
        assert dist.optim == sft.optim  # every optimizer field: lr, schedule, warmup, decay, Muon, MTP weights
        assert dist.optim.mtp_lambda == sft.optim.mtp_lambda == 0.0
        for k in ("max_steps", "batch_size", "grad_accum", "seed"):
            assert getattr(dist.train, k) == getattr(sft.train, k), k
        assert dist.train.max_steps == sc.opd_steps and dist.train.batch_size == sc.opd_batch
        assert dist.distill.max_new_tokens == sc.opd_new_tokens
        assert sft.data.seq_len == sc.opd_prompt_tokens + sc.opd_new_tokens
        assert sft.data.source == str(tmp_path / "opd/teacher" / f"seed-{seed}" / "samples/samples.jsonl")
        assert sft.model == st.model  # the sft run's --init is the student parent's architecture
        cmd = command_line(ropd, sc)
        assert cmd.startswith(f"k3 distill --student {tmp_path}/opd/student/seed-{seed}/final --teacher teacher=")
        assert f"--prompts {tmp_path}/opd/prompts/train.jsonl --preset {sc.opd_preset}" in cmd
        assert command_line(rsft, sc).startswith(f"k3 pretrain --preset {sc.preset} --init "
                                                 f"{tmp_path}/opd/student/seed-{seed}/final")


def vars_of(section):
    import dataclasses

    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def test_placeholders_resolve_from_the_base_model(tmp_path):
    runs = plan([SUITES["latent_moe"], SUITES["hybrid"], SUITES["muon"]], SCALES["tiny"], 1, tmp_path, resolve)
    cfgs = {r.arm.label: resolve_run(r, SCALES["tiny"], resolve) for r in runs}
    assert cfgs["standard"].model.moe_latent_size == cfgs["standard"].model.d_model == 128
    assert cfgs["standard"].model.moe_intermediate_size == cfgs["latent"].model.moe_intermediate_size // 2
    # equal active expert parameters per token: K x 3 x m x l
    ex = {k: c.model.num_experts_per_tok * 3 * c.model.moe_intermediate_size * c.model.moe_latent_size
          for k, c in cfgs.items() if k in ("latent", "standard")}
    assert ex["latent"] == ex["standard"]
    assert cfgs["all-mla"].model.full_attn_layers == list(range(1, 9))
    assert cfgs["all-kda"].model.full_attn_layers == [] and cfgs["hybrid"].model.full_attn_layers == [4, 8]
    assert cfgs["clip-high-lr"].optim.qk_clip_tau == 3.0 and cfgs["noclip-high-lr"].optim.qk_clip_tau is None
    assert cfgs["clip-high-lr"].optim.lr == cfgs["noclip-high-lr"].optim.lr == 0.05


# ---------------------------------------------------------------------------------------------------- stubbed runner

# per (arm, seed): the final val_loss the stub records; the report must show their mean / min / max
STUB_LOSS = {("attnres", 0): 2.50, ("attnres", 1): 2.46, ("preln", 0): 2.55, ("preln", 1): 2.52,
             ("attnres-b1", 0): 2.60, ("attnres-b1", 1): 2.58,
             ("qb", 0): 2.40, ("qb", 1): 2.42, ("loss_free", 0): 2.41, ("loss_free", 1): 2.40}
STUB_VIOL = {"qb": 0.2, "loss_free": 0.9}


def fake_run(calls):
    def run(cfg, *, run_dir, resume=False, run_config=None, console=None, prepare_model=None, command="", **kw):
        arm, seed = run_config["ablate"]["arm"], run_config["ablate"]["seed"]
        calls.append((str(run_dir), resume))
        run_dir.mkdir(parents=True, exist_ok=True)
        rc = dict(run_config)
        rc["stats"] = {"final_val_loss": STUB_LOSS[(arm, seed)], "final_val_bpb": STUB_LOSS[(arm, seed)] / 2,
                       "n_params_active": 1000}
        (run_dir / "run_config.yaml").write_text(yaml.safe_dump(rc, sort_keys=False))
        with open(run_dir / "metrics.jsonl", "w") as fh:
            fh.writelines(json.dumps({"step": step, "loss": 3.0 - 0.01 * step, "tokens_per_s": 100.0 * step,
                                      "router_max_violation": STUB_VIOL.get(arm, 0.5) + 0.01 * step,
                                      "router_cv": 0.1, "max_attn_logit": 5.0}) + "\n"
                          for step in range(1, cfg.train.max_steps + 1))
            fh.write(json.dumps({"step": cfg.train.max_steps, "val_loss": STUB_LOSS[(arm, seed)]}) + "\n")
        (run_dir / "final").mkdir(exist_ok=True)
        (run_dir / "final" / "config.json").write_text("{}")
        return SimpleNamespace(final_dir=run_dir / "final", stop_signal=None)

    return run


def test_runner_skips_resumes_refuses_changed_config_and_reports(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pretrain_mod, "run", fake_run(calls))
    out = tmp_path / "abl"
    res = run_suites(["attnres", "balance"], "tiny", 2, out, resolve=resolve, console=quiet())
    assert len(calls) == 10 and not any(r for _, r in calls) and res["skipped"] == []
    assert {c[0] for c in calls} == {str(out / s / a / f"seed-{i}") for s, arms in
                                     (("attnres", ("attnres", "preln", "attnres-b1")), ("balance", ("qb", "loss_free")))
                                     for a in arms for i in (0, 1)}
    rc = yaml.safe_load((out / "attnres/preln/seed-1/run_config.yaml").read_text())
    assert rc["config"]["model"]["residual"] == "preln" and rc["config"]["train"]["seed"] == 1
    assert rc["config"]["train"]["max_steps"] == SCALES["tiny"].steps
    assert rc["ablate"]["command"].startswith("k3 pretrain --preset tiny --set train.max_steps=60")

    # again: every run finished with the same config -> skipped, nothing trained
    calls.clear()
    res = run_suites(["attnres", "balance"], "tiny", 2, out, resolve=resolve, console=quiet())
    assert calls == [] and len(res["skipped"]) == 10

    # an interrupted run (a checkpoint, no final/): an error naming --resume without it, resumed with it
    rd = out / "attnres/preln/seed-0"
    shutil.rmtree(rd / "final")
    (rd / "checkpoints/step-0000030").mkdir(parents=True)
    with pytest.raises(AblateError, match=r"interrupted.*--resume"):
        run_suites(["attnres"], "tiny", 2, out, resolve=resolve, console=quiet())
    run_suites(["attnres"], "tiny", 2, out, resume=True, resolve=resolve, console=quiet())
    assert calls == [(str(rd), True)]

    # a finished run whose recorded config differs: an error naming its directory
    rd2 = out / "attnres/attnres/seed-1"
    rc2 = yaml.safe_load((rd2 / "run_config.yaml").read_text())
    rc2["config"]["train"]["max_steps"] = 61
    (rd2 / "run_config.yaml").write_text(yaml.safe_dump(rc2))
    with pytest.raises(AblateError, match=str(rd2)):
        run_suites(["attnres"], "tiny", 2, out, resolve=resolve, console=quiet())
    rc2["config"]["train"]["max_steps"] = 60
    (rd2 / "run_config.yaml").write_text(yaml.safe_dump(rc2))

    # the report: means and min-max of what the stubs wrote, verdicts, plots, a missing run
    shutil.rmtree(out / "balance/loss_free/seed-1/final")
    report = write_report(out).read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in report.splitlines() if line.startswith("| ") and not line.startswith("| arm")}
    assert rows["attnres"][:2] == ["2", "2.4800 [2.4600, 2.5000]"]
    assert rows["preln"][1] == "2.5350 [2.5200, 2.5500]"
    assert rows["attnres-b1"][2] == "1.2950 [1.2900, 1.3000]"  # val_bpb
    # tokens_per_s: the median of the logged values without the first (100 * steps 2..60)
    tps = f"{statistics.median(100.0 * s for s in range(2, 61)):,.0f}"
    assert rows["attnres"][3] == f"{tps} [{tps}, {tps}]"
    # router violation: mean over the second half of the logged steps (31..60); loss_free seed 1 is missing
    viol = 0.9 + 0.01 * statistics.mean(range(31, 61))
    assert rows["loss_free"][0] == "1" and rows["loss_free"][2] == f"{viol:.3f}"
    d = [STUB_LOSS[("attnres", s)] - STUB_LOSS[("preln", s)] for s in (0, 1)]
    assert (f"attnres lowers val loss vs Pre-LN: **yes**, val_loss attnres - preln = {statistics.mean(d):.4g} "
            f"+- {statistics.stdev(d):.4g} (sample std over 2 seeds)") in report
    assert "qb lowers router max violation vs loss-free: **yes**" in report and "(1 seed)" in report
    assert "qb loss equal or better than loss-free: **yes**, val_loss qb - loss_free = -0.01 (1 seed)" in report
    assert "Missing" in report and "balance/loss_free/seed-1 (balance/loss_free/seed-1)" in report
    assert "k3 ablate attnres --scale tiny --seeds 2 --out" in report
    for png in ("attnres/loss.png", "balance/loss.png", "balance/router.png"):
        p = out / "plots" / png
        assert p.is_file() and p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"
        assert f"plots/{png}" in report


def test_a_failing_run_names_its_dir_and_the_resume_command(tmp_path, monkeypatch):
    def boom(cfg, *, run_dir, **kw):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pretrain_mod, "run", boom)
    with pytest.raises(AblateError, match=r"(?s)schedule/cosine/seed-0 failed in .*disk full.*k3 ablate schedule "
                                          r"--scale tiny --seeds 1 --out .* --resume"):
        run_suites(["schedule"], "tiny", 1, tmp_path, resolve=resolve, console=quiet())


def test_names_and_scales_are_checked(tmp_path):
    with pytest.raises(AblateError, match="unknown suite 'nosuch'; valid names: attnres, c2glu"):
        run_suites(["nosuch"], "tiny", 1, tmp_path, resolve=resolve)
    with pytest.raises(AblateError, match="--scale 'huge'"):
        run_suites(["attnres"], "huge", 1, tmp_path, resolve=resolve)
    assert all(s.wired for s in SUITES.values())
    with pytest.raises(AblateError, match="not a k3 ablate directory"):
        write_report(tmp_path)


# ---------------------------------------------------------------------------------------------------- GLU recorder


def _c2glu(g, u, b1=4.0, b2=25.0):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


def test_glu_recorder_matches_direct_max_and_writes_at_eval(tmp_path):
    cfg = ModelConfig(first_k_dense=1, mtp_depth=0)
    model = build_model(cfg, seed=0, device="cpu")
    for p in model.parameters():  # larger weights, so that activations are far from the init's small values
        p.data.mul_(8.0)
    inputs = []
    for m in model.modules():
        if isinstance(m, (GatedMLP, GroupedExperts)):
            m.register_forward_pre_hook(lambda mod, args: inputs.append((mod, [a.detach() for a in args])))
    rec = GluMaxRecorder(tmp_path, grad_accum=2)
    assert rec.install(model) >= 3  # dense MLP, shared experts and routed experts of each MoE layer
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    model.train()
    for _ in range(4):
        model(tokens)
    expect = 0.0
    with torch.no_grad():
        expect = _direct_max(inputs)
    assert expect > 1.0
    assert math.isclose(rec.max_abs, expect, rel_tol=1e-5)
    model.eval()
    with torch.no_grad():
        model(tokens * 0)  # an evaluation forward: records the running max, does not change it
    lines = [json.loads(x) for x in (tmp_path / "glu_max.jsonl").read_text().splitlines()]
    assert lines == [{"step": 2, "max_abs_h": rec.max_abs, "per_kind": rec.per_kind}]
    assert set(rec.per_kind) == {"dense", "shared", "routed"}
    again = GluMaxRecorder(tmp_path, grad_accum=2)  # a resumed run continues from the file
    assert again.max_abs == rec.max_abs and again.forwards == 4


def _direct_max(inputs) -> float:
    """max |h| recomputed from each GLU module's captured input with the C2-GLU formula (per expert for the routed
    ones), independent of the recorder's hooks."""
    expect = 0.0
    for mod, args in inputs:
        if isinstance(mod, GatedMLP):
            g, u = (args[0] @ mod.gate_up_proj.weight.T).split(mod.d_ff, -1)
            expect = max(expect, float(_c2glu(g, u).abs().max()))
        else:
            x, counts = args
            start = 0
            for e, n in enumerate(counts.tolist()):
                g, u = (x[start:start + n] @ mod.gate_up_proj[e].T).split(mod.d_ff, -1)
                start += n
                if n:
                    expect = max(expect, float(_c2glu(g, u).abs().max()))
    return expect


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_list_help_and_errors(tmp_path):
    res = runner.invoke(app, ["ablate", "--list"])
    assert res.exit_code == 0
    lines = res.output.strip().splitlines()
    assert len(lines) == len(SUITES) and lines[0].startswith("attnres") and "1. Block Attention" in lines[0]
    assert [line.split()[0] for line in lines if "not wired" in line] == []
    assert any(line.startswith("opd") and "9. On-policy distillation" in line for line in lines)
    res = runner.invoke(app, ["ablate", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--report-only" in res.output and "--seeds" in res.output
    res = runner.invoke(app, ["ablate", "nosuch", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown suite 'nosuch'; valid names: attnres" in res.output
    res = runner.invoke(app, ["ablate", "attnres"])
    assert res.exit_code == 2 and "--out DIR is required" in res.output
    assert "ablate" in runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output


# ---------------------------------------------------------------------------------------------------- real smoke


def smoke_scale(tmp_path):
    """A debug-sized scale: 3 pretrain steps of 4 x 128 tokens, extensions to 256 and QAT of 8 steps."""
    return Scale("smoke", "debug", steps=3, eval_every=3, extend_preset="tiny", extend_steps=8, extend_seq_len=256,
                 passkey_lengths=(256,), hybrid_passkey_lengths=(128,), passkey_depths=(0.5,), passkey_trials=1,
                 quantize_steps=8, loss_batches=1,
                 extra_sets=(f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=300000",
                             "data.tokenizer_sample_bytes=100000", "data.seq_len=128", "train.batch_size=4",
                             "train.eval_batches=1", "train.threads=1", "train.log_every=1", "optim.warmup_steps=1"))


def test_real_attnres_suite_debug_sized_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setitem(SCALES, "smoke", smoke_scale(tmp_path))
    out = tmp_path / "abl"
    res = run_suites(["attnres"], "smoke", 1, out, resolve=resolve, console=quiet())
    assert len(res["ran"]) == 3 and res["stopped"] is None
    for arm in ("attnres", "preln", "attnres-b1"):
        r = read_run(out / "attnres" / arm / "seed-0")
        assert r is not None and math.isfinite(r["metrics"]["val_loss"]) and len(r["train"]) == 3
    pre = yaml.safe_load((out / "attnres/preln/seed-0/run_config.yaml").read_text())["config"]["model"]
    assert pre["residual"] == "preln" and pre["name"] == "k3-debug"
    report = (out / "report.md").read_text()
    assert "attnres lowers val loss vs Pre-LN: **" in report and "not tested" not in report
    assert (out / "plots/attnres/loss.png").stat().st_size > 1000
    assert run_suites(["attnres"], "smoke", 1, out, resolve=resolve, console=quiet())["ran"] == []


def test_real_nope_and_qat_suites_debug_sized_end_to_end(tmp_path, monkeypatch):
    from k3.serve.generate import generate_batch

    monkeypatch.setitem(SCALES, "smoke", smoke_scale(tmp_path))
    out = tmp_path / "abl"
    res = run_suites(["nope", "qat"], "smoke", 1, out, resolve=resolve, generate_batch=generate_batch,
                     console=quiet())
    assert len(res["ran"]) == 7 and res["stopped"] is None
    for arm, pos in (("extend-nope", "nope"), ("extend-rope", "rope")):
        rc = yaml.safe_load((out / "nope" / arm / "seed-0/run_config.yaml").read_text())
        assert rc["config"]["model"]["mla_position"] == pos and rc["config"]["data"]["seq_len"] == 256
        assert rc["parent_checkpoint"] == str(out / "nope/parent/seed-0/final")
        pk = json.loads((out / "nope" / arm / "seed-0/passkey/passkey.json").read_text())
        assert pk["lengths"] == [256] and pk["trials"] == 1
    qc = yaml.safe_load((out / "qat/ptq/seed-0/run_config.yaml").read_text())
    assert qc["source"] == str(out / "qat/bf16-ft/seed-0/final") and qc["quantization_config"]["format"] == "w4a8"
    losses = {a: json.loads((out / "qat" / a / "seed-0/loss/loss.json").read_text()) for a in
              ("parent", "bf16-ft", "ptq", "qat")}
    assert len({(x["tokens"], x["seq_len"]) for x in losses.values()}) == 1  # one evaluation for every release
    report = (out / "report.md").read_text()
    assert "NoPE extension passkey above RoPE-kept: **" in report and "QAT release loss below PTQ's: **" in report
    assert (out / "plots/nope/passkey-extend-nope-seed-0.png").stat().st_size > 1000


def test_real_opd_suite_debug_sized_end_to_end(tmp_path, monkeypatch):
    from k3.model.checkpoint import load_model
    from k3.model.tokenizer import K3Tokenizer
    from k3.serve.generate import generate_batch
    from k3.train.ablate_opd import EVAL_SALT

    sc = replace(smoke_scale(tmp_path), opd_teacher_steps=8, opd_student_steps=2, opd_steps=3, opd_batch=4,
                 opd_prompt_tokens=16, opd_new_tokens=8, opd_eval_prompts=4, opd_sft_val_fraction=0.3)
    monkeypatch.setitem(SCALES, "smoke", sc)
    out = tmp_path / "abl"
    res = run_suites(["opd"], "smoke", 1, out, resolve=resolve, generate_batch=generate_batch, console=quiet())
    assert res["ran"] == [f"opd/{a}/seed-0" for a in ("teacher", "student", "opd", "sft")]
    opd = out / "opd"
    # the prompts: the train split's windows for training, the val split's for the evaluation, made once
    train = [json.loads(x)["prompt"] for x in (opd / "prompts/train.jsonl").read_text().splitlines()]
    held = [json.loads(x)["prompt"] for x in (opd / "prompts/eval.jsonl").read_text().splitlines()]
    assert len(train) == 12 and len(held) == 4 and not set(train) & set(held)
    # the SFT data: the teacher's completion of each train prompt, and the sft run trained on it from the student
    samples = [json.loads(x) for x in (opd / "teacher/seed-0/samples/samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == [p for p in train if p in {s["prompt"] for s in samples}]
    assert len(samples) >= 10 and all(s["completion"].strip() for s in samples)
    src = yaml.safe_load((opd / "sft/seed-0/run_config.yaml").read_text())
    assert src["init"] == str(opd / "student/seed-0/final") and src["config"]["train"]["max_steps"] == 3
    assert src["config"]["data"]["source"] == str(opd / "teacher/seed-0/samples/samples.jsonl")
    drc = yaml.safe_load((opd / "opd/seed-0/run_config.yaml").read_text())
    assert drc["teachers"] == {"teacher": str(opd / "teacher/seed-0/final")} and drc["stats"]["steps"] == 3
    ev = {a: json.loads((opd / a / "seed-0/opd_eval/opd_eval.json").read_text())
          for a in ("teacher", "student", "opd", "sft")}
    assert ev["teacher"]["reverse_kl"] < 1e-5  # the teacher against itself
    assert math.isclose(ev["teacher"]["teacher_nll"], ev["teacher"]["teacher_self_nll"], rel_tol=1e-5)
    assert all(e["reverse_kl"] > 1e-3 for a, e in ev.items() if a != "teacher")
    # opd: prompts x logged completion length, at most prompts x max_new_tokens; sft: its windows' mask fraction
    assert 0 < ev["opd"]["completion_tokens_per_step"] <= 4 * 8
    assert 0 < ev["sft"]["completion_tokens_per_step"] < 4 * 24
    assert ev["teacher"]["completion_tokens_per_step"] is None

    # teacher_nll of the sft student, recomputed in float64: the teacher's samples of the held-out prompts with the
    # evaluation's seeds, the student's log-probability of each completion token
    tok = K3Tokenizer.from_file(opd / "teacher/seed-0/final")
    teacher, _ = load_model(opd / "teacher/seed-0/final", device="cpu")
    student, _ = load_model(opd / "sft/seed-0/final", device="cpu")
    prompts = [tok.encode(p, add_bos=True) for p in held]
    seeds = [int(s) for s in np.random.default_rng([0, EVAL_SALT]).integers(2**31 - 1, size=len(held))]
    outs = generate_batch(teacher, tok, prompts, max_tokens=8, temperature=1.0, top_p=1.0, seeds=seeds)
    total, n = 0.0, 0
    with torch.no_grad():
        for p, c in zip(prompts, outs):
            logp = student.eval()(torch.tensor([p + c])[:, :-1]).logits.double().log_softmax(-1)[0]
            total -= sum(float(logp[len(p) - 1 + j, t]) for j, t in enumerate(c))
            n += len(c)
    assert n == ev["sft"]["teacher_completion_tokens"]
    assert math.isclose(ev["sft"]["teacher_nll"], total / n, rel_tol=1e-4)

    losses = {a: json.loads((opd / a / "seed-0/loss/loss.json").read_text()) for a in ev}
    assert len({(x["tokens"], x["seq_len"]) for x in losses.values()}) == 1  # one held-out text for every release
    report = (out / "report.md").read_text()
    claims = ("the teacher's held-out loss is below the student parent's",
              "OPD lowers the reverse KL to the teacher on held-out prompts vs SFT: **",
              "OPD lowers the loss on the teacher's samples")
    for claim in claims:
        assert claim in report
    assert "not tested" not in report and "Missing" not in report
    assert "k3 distill --student" in report and (out / "plots/opd/opd.png").stat().st_size > 1000
    assert run_suites(["opd"], "smoke", 1, out, resolve=resolve, generate_batch=generate_batch,
                      console=quiet())["ran"] == []
