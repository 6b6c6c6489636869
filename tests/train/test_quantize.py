"""`k3 quantize` below the CLI (k3.train.quantize, k3.train.calibrate): the clip search against a brute-force
output-error reference, the Gram recorder against the inputs it saw, calibrated ptq, QAT through the pretrain loop
(exact resume, prompt/completion JSONL, the release computing the trained fake-quant logits), and the checks that
run before anything is written; the same for QAT with learned scales started from the calibrated clipping."""

import json
import os
import signal

import pytest
import torch
import yaml

import k3.train.loop as loop_mod
import k3.train.quantize as quantize_mod
from k3.cli.config import resolve_config
from k3.kernels.quant import int4_group_codes, int4_group_scales
from k3.model.checkpoint import CheckpointError, load_model, read_quantization_config
from k3.model.config import ConfigError
from k3.model.quant import enable_fake_quant, make_quantization_config
from k3.train.calibrate import GramRecorder, clip_ratios, search_clip
from k3.train.pretrain import run as pretrain_run
from k3.train.quantize import run

FAST = ["data.max_bytes=400000", "train.batch_size=4", "train.log_every=1", "train.eval_every=0",
        "train.eval_batches=2", "ckpt.every=0", "train.threads=1", "data.seq_len=64", "quantize.calib_batches=2",
        "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3cache"))


@pytest.fixture(scope="module")
def release(tmp_path_factory, cache_dir):
    """A k3-debug release trained for a few steps on the standard library (with its tokenizer)."""
    cfg = resolve_config("pretrain", preset="debug", sets=[
        f"data.cache_dir={cache_dir}", "data.max_bytes=400000", "data.tokenizer_sample_bytes=200000",
        "train.batch_size=4", "train.eval_every=0", "train.eval_batches=2", "ckpt.every=0", "train.threads=1",
        "train.max_steps=8"])
    return pretrain_run(cfg, run_dir=tmp_path_factory.mktemp("src") / "run").final_dir


def _cfg(cache_dir, *sets):
    return resolve_config("quantize", preset="default", sets=[f"data.cache_dir={cache_dir}", *FAST, *sets])


def _losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def test_clip_search_matches_brute_force_output_error():
    g = torch.Generator().manual_seed(0)
    N, K, T, group = 6, 64, 200, 16
    w = torch.randn(N, K, generator=g)
    x = torch.randn(T, K, generator=g) * torch.linspace(0.2, 2.0, K)  # uneven input scales
    gram = torch.einsum("tgi,tgj->gij", *(x.double().reshape(T, -1, group),) * 2)
    ratios = clip_ratios(10, 0.5)
    s, st = search_clip(w, gram, group, ratios)
    # brute force: the output error each group adds, sum_t (x_tj . (w_nj - Q(w_nj)))^2, per ratio
    s_rtn = int4_group_scales(w, group)
    errs = []
    for r in ratios:
        q = int4_group_codes(w, s_rtn * r).double().reshape(N, -1, group) * (s_rtn * r).double()[..., None]
        d = w.double().reshape(N, -1, group) - q  # [N, G, g]
        out = torch.einsum("tgi,ngi->tng", x.double().reshape(T, -1, group), d)
        errs.append(out.square().sum(0))  # [N, G]
    errs = torch.stack(errs)  # [R, N, G]
    best = errs.argmin(0)  # first minimum: ties keep the larger ratio
    assert torch.equal(s, s_rtn * torch.tensor(ratios)[best])
    assert st["rtn_error"] == pytest.approx(errs[0].sum().item(), rel=1e-9)
    assert st["error"] == pytest.approx(errs.min(0).values.sum().item(), rel=1e-9)
    assert st["error"] < st["rtn_error"] and (best > 0).any()  # some groups clip, none does worse than RTN
    assert clip_ratios(20, 0.5) == [1 - i / 20 for i in range(11)]


def test_gram_recorder_sees_each_weights_inputs():
    from k3.model.config import ModelConfig
    from k3.model.transformer import build_model

    cfg = ModelConfig()
    model = build_model(cfg, seed=0).eval()
    qc = make_quantization_config("w4a16", 16, "all_linear")
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    seen = {}
    head = model.model.layers[0].mlp.down_proj  # the dense MLP's [D, F] projection
    def keep(module, args):  # returns None: the input goes on unchanged
        seen.setdefault("head", args[0].detach().reshape(-1, args[0].shape[-1]))

    h = head.register_forward_pre_hook(keep)
    ex = model.model.layers[2].mlp.experts
    ex.input_observer = lambda name, x, c: seen.setdefault(name, (x.detach(), c.clone()))
    with torch.no_grad():
        model(tokens)
    h.remove()
    ex.input_observer = None
    rec = GramRecorder(model, qc)
    with rec, torch.no_grad():
        model(tokens)
    assert ex.input_observer is None and not head._forward_pre_hooks  # the hooks are gone afterwards
    x = seen["head"].double().reshape(-1, cfg.dense_intermediate_size // 16, 16)
    assert torch.allclose(rec.grams["model.layers.0.mlp.down_proj.weight"], torch.einsum("tgi,tgj->gij", x, x))
    assert "lm_head.weight" not in rec.grams  # the head keeps its RTN scales (calibrate.KEEP_RTN)
    x, counts = seen["down_proj"]
    e = int(counts.argmax())
    rows = x[int(counts[:e].sum()):int(counts[:e + 1].sum())].double().reshape(-1, x.shape[1] // 16, 16)
    assert torch.allclose(rec.grams["model.layers.2.mlp.experts.down_proj"][e], torch.einsum("tgi,tgj->gij", rows,
                                                                                               rows))


def test_calibrated_ptq_writes_a_quantized_release(release, tmp_path, cache_dir):
    res = run(_cfg(cache_dir, "quantize.data=stdlib"), ckpt=release, run_dir=tmp_path / "q")
    assert set(res.val_losses) == {"source", "rtn", "calibrated"}
    for f in ("run_config.yaml", "metrics.jsonl", "tokenizer/tokenizer.json", "final/config.json"):
        assert (tmp_path / "q" / f).is_file(), f
    qc = read_quantization_config(res.final_dir)
    assert qc["mode"] == "ptq" and qc["modules"] == ["routed_experts"] and qc["format"] == "w4a8"
    model, _ = load_model(res.final_dir)
    assert model(torch.zeros(1, 4, dtype=torch.long)).logits.isfinite().all()


@pytest.mark.parametrize("learned", [False, True], ids=["absmax", "learned-calibrated"])
def test_qat_resume_is_bit_exact_and_the_release_computes_the_trained_model(release, tmp_path, cache_dir,
                                                                           monkeypatch, learned):
    sets = ("quantize.mode=qat", "quantize.data=stdlib", "quantize.modules=all_linear", "quantize.group_size=16",
            "train.max_steps=6")
    # learned: a large scale lr so that six steps move the scales visibly
    sets += (("quantize.scales=learned", "quantize.scale_init=calibrated", "quantize.scale_lr=5") if learned
             else ("quantize.scales=absmax",))
    calibrations, real_calibrate = [], quantize_mod._calibrate_source

    def counted(*a, **kw):
        calibrations.append(1)
        return real_calibrate(*a, **kw)

    monkeypatch.setattr(quantize_mod, "_calibrate_source", counted)
    full = run(_cfg(cache_dir, *sets), ckpt=release, run_dir=tmp_path / "full")
    real_lr_at = loop_mod.lr_at

    def lr_at_with_sigterm(step, cfg, max_steps):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop finishes step 3, saves, returns
        return real_lr_at(step, cfg, max_steps)

    monkeypatch.setattr(loop_mod, "lr_at", lr_at_with_sigterm)
    first = run(_cfg(cache_dir, *sets), ckpt=release, run_dir=tmp_path / "split")
    assert first.final_dir is None and first.stop_signal == signal.SIGTERM
    monkeypatch.setattr(loop_mod, "lr_at", real_lr_at)
    second = run(_cfg(cache_dir, *sets), ckpt=release, run_dir=tmp_path / "split", resume=True)
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full") and len(_losses(tmp_path / "full")) == 6
    assert len(calibrations) == (2 if learned else 0)  # the resumed run reads its scales from the checkpoint
    assert second.val_losses == full.val_losses
    qc = read_quantization_config(full.final_dir)
    assert qc["mode"] == "qat" and qc["modules"] == ["routed_experts", "shared_experts", "linear"]
    # the release equals the fake-quant model of the last training checkpoint's weights
    from k3.model.checkpoint import load_release
    from k3.model.transformer import build_model
    from k3.train.checkpoint import load_checkpoint

    ck = load_checkpoint(max((tmp_path / "full" / "checkpoints").iterdir()))
    cfg, _ = load_release(release)
    fq = enable_fake_quant(build_model(cfg, seed=0), qc, scales="learned" if learned else "absmax")
    fq.load_state_dict(ck["model_state"])
    q, _ = load_model(full.final_dir)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(q(tokens).logits, fq.eval()(tokens).logits)
    scales = {k[:-len("_scales")]: v for k, v in ck["model_state"].items() if k.endswith("_scales")}
    assert bool(scales) == learned
    if learned:  # the release holds the trained scales; they moved from the calibrated start
        rc = yaml.safe_load((tmp_path / "full" / "run_config.yaml").read_text())
        assert rc["qat"]["scales"] == "learned" and rc["qat"]["calibration"]["calibrated_rel_output_error"] > 0
        _, qsd = load_release(full.final_dir)
        assert all(torch.equal(qsd[k + ".scales"], v) for k, v in scales.items())
        src, _ = load_model(release, dtype=torch.float32)
        assert not torch.equal(scales["lm_head.weight"], int4_group_scales(src.lm_head.weight, 16))  # its RTN start


def test_qat_on_prompt_completion_jsonl(release, tmp_path, cache_dir, monkeypatch):
    """QAT in SFT: the train loop's loss sees masks that leave the prompt tokens out."""
    rows = [{"prompt": f"def f{i}(x):\n    return ", "completion": f"x * {i} + {i % 7}\n"} for i in range(400)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    masks, real = [], loop_mod.lm_losses

    def spy(model, tokens, mask, *a, **kw):
        masks.append(mask.clone())
        return real(model, tokens, mask, *a, **kw)

    monkeypatch.setattr(loop_mod, "lm_losses", spy)
    res = run(_cfg(cache_dir, "quantize.mode=qat", f"quantize.data={data}", "train.max_steps=3",
                   "data.val_fraction=0.1"), ckpt=release, run_dir=tmp_path / "sft")
    assert res.final_dir is not None and "qat" in res.val_losses
    assert len(masks) >= 3 and all(0.2 < m.float().mean() < 0.8 for m in masks)  # completions only


@pytest.mark.parametrize(("sets", "err", "match"), [
    (("quantize.mode=qat",), ConfigError, "--mode qat fine-tunes the fake-quantized model, so it needs --data"),
    (("quantize.group_size=64",), CheckpointError, (r"group size 64 does not divide the in-features 32 of "
                                                    r"model.layers.1.mlp.experts.gate_up_proj.*\[16, 32\]")),
    (("quantize.method=w8a16", "quantize.modules=all_linear"), CheckpointError,
     "format w8a16 does not support the linear modules"),
    (("quantize.method=int3",), ConfigError, "quantize.method 'int3'"),
    (("quantize.group_size=24",), ConfigError, r"quantize.group_size 24: use one of \[16, 32, 64, 128\]"),
    (("quantize.scales=lsq",), ConfigError, r"quantize.scales 'lsq': use one of \['absmax', 'learned'\]"),
    (("quantize.scale_init=gptq",), ConfigError, r"quantize.scale_init 'gptq': use one of \['rtn', 'calibrated'\]"),
    (("quantize.scale_lr=0",), ConfigError, "quantize.scale_lr 0.0 must be > 0"),
], ids=["qat-no-data", "group", "format-modules", "method", "group-choice", "scales", "scale-init",
        "scale-lr"])
def test_errors_write_nothing(release, tmp_path, cache_dir, sets, err, match):
    with pytest.raises(err, match=match):
        run(_cfg(cache_dir, *sets), ckpt=release, run_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_already_quantized_input(release, tmp_path, cache_dir):
    first = run(_cfg(cache_dir), ckpt=release, run_dir=tmp_path / "q1")
    with pytest.raises(CheckpointError, match=r"already quantized \(w4a8, ptq\); quantize the bf16 / fp32 release"):
        run(_cfg(cache_dir, "quantize.mode=qat", "quantize.data=stdlib"), ckpt=first.final_dir,
            run_dir=tmp_path / "q2")
    assert not (tmp_path / "q2").exists()
    with pytest.raises(ConfigError, match="ptq has no training to resume"):
        run(_cfg(cache_dir), ckpt=release, run_dir=tmp_path / "q1", resume=True)
