"""`k3 quantize`: a release checkpoint -> a quantized release (model/README.md "Quantized release checkpoints").

- ptq: round-to-nearest symmetric quantization of the selected modules; with `quantize.data`, a calibration pass
  first picks each int4 group's clipping scale by the output error (k3.train.calibrate), and the validation loss of
  the source, of RTN and of the calibrated release are measured on the data's validation split.
- qat: the selected modules fake-quantized (k3.model.quant.enable_fake_quant: weights and per-token activations,
  straight-through gradients), fine-tuned by `k3 pretrain`'s run (train/pretrain.py: the same loop, optimiser,
  checkpoints, resume and progress) on `quantize.data` (plain text, or prompt / completion JSONL with the loss on
  the completion only), then converted with the scales the fake quantizer used: the weights' absmax, or with
  `quantize.scales: learned` per-group scale parameters trained with the weights (LSQ, k3.kernels.quant.fake),
  started from absmax / 7 or from ptq's calibrated clipping (`quantize.scale_init`).

RUN_DIR (pretrain's layout): run_config.yaml, metrics.jsonl, tokenizer/, checkpoints/step-N/ (qat), final/ (the
quantized release). Every check a user can act on runs before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from k3.model.checkpoint import (
    CheckpointError,
    instantiate,
    load_model,
    load_release,
    read_quantization_config,
    read_release_config,
    save_release,
)
from k3.model.config import ConfigError, ModelConfig
from k3.model.quant import (
    FORMATS,
    GROUP_SIZES,
    MODES,
    MODULE_CHOICES,
    QAT_SCALES,
    apply_quantization,
    check_targets,
    enable_fake_quant,
    make_quantization_config,
    pop_learned_scales,
    quantize_state_dict,
)
from k3.model.transformer import K3Model

from .calibrate import GramRecorder, calibrated_scales, clip_ratios
from .config import QuantizeConfig
from .console import make_console
from .data import BatchLoader, prepare_data
from .loop import lm_losses
from .pretrain import resolve_autocast, resolve_device

SCALE_INITS = ("rtn", "calibrated")  # quantize.scale_init of learned QAT scales


@dataclass
class QuantizeResult:
    run_dir: Path
    final_dir: Path | None  # None when a qat run was stopped by a signal
    val_losses: dict[str, float]  # "source", "rtn", "calibrated", "qat": whichever were measured
    stop_signal: int | None = None


def quantize_release(src_dir: str | Path, out_dir: str | Path, fmt: str = "w4a8", group_size: int | None = 32, *,
                     modules: str = "routed_experts", scales: dict[str, torch.Tensor] | None = None,
                     run_info: dict | None = None) -> Path:
    """Read a bf16 / fp32 release, quantize the selected modules (RTN, or on given `scales`), write a new release
    (atomically, via save_release) with quantization_config in config.json; tokenizer files and
    generation_config.json are kept.

    Example: quantize_release("runs/x/final", "runs/x/final-q", fmt="w4a8", group_size=32)
    """
    src, out = Path(src_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise CheckpointError(f"{out}: quantize_release writes a new release; choose an output directory other than "
                              "the source")
    _check_unquantized(src)
    cfg, sd = load_release(src)
    qsd, qc = quantize_state_dict(sd, cfg, fmt, group_size, modules, scales=scales)
    return _save(src, out, qsd, cfg, qc, {"algorithm": "rtn" if scales is None else "calibrated", **(run_info or {})})


def _check_unquantized(src: Path) -> None:
    qc = read_quantization_config(src)
    if qc is not None:
        raise CheckpointError(f"{src}: already quantized ({qc['format']}, {qc['mode']}); quantize the bf16 / fp32 "
                              "release it was made from")


def _save(src: Path, out: Path, qsd: dict, cfg: ModelConfig, qc: dict, info: dict) -> Path:
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else None
    parent_run = src / "k3_run.yaml"
    run_info = {"parent_checkpoint": str(src), "quantization": {**qc, **info.pop("quantization", {})},
                **({"parent_run": yaml.safe_load(parent_run.read_text(encoding="utf-8"))}
                   if parent_run.is_file() else {}), **info}
    tok = src if (src / "tokenizer.json").is_file() else None
    return save_release(out, qsd, cfg, tokenizer_dir=tok, run_info=run_info, generation_config=gen,
                        quantization_config=qc)


def check_request(qcfg: QuantizeConfig, ckpt: str | Path) -> tuple[ModelConfig, dict]:
    """The checks of `k3 quantize` that need no data: (the source's ModelConfig, the quantization_config). Raises
    ConfigError / CheckpointError naming the problem and the fix."""
    if qcfg.mode not in MODES:
        raise ConfigError(f"quantize.mode {qcfg.mode!r}: use one of {list(MODES)} (--mode)")
    if qcfg.method not in FORMATS:
        raise ConfigError(f"quantize.method {qcfg.method!r}: use one of {list(FORMATS)} (--method)")
    if qcfg.modules not in MODULE_CHOICES:
        raise ConfigError(f"quantize.modules {qcfg.modules!r}: use one of {list(MODULE_CHOICES)} (--modules)")
    if qcfg.method != "w8a16" and qcfg.group_size not in GROUP_SIZES:
        raise ConfigError(f"quantize.group_size {qcfg.group_size}: use one of {list(GROUP_SIZES)} (--group-size)")
    if qcfg.mode == "qat" and not qcfg.data:
        raise ConfigError("--mode qat fine-tunes the fake-quantized model, so it needs --data SOURCE (text files, "
                          "prompt/completion JSONL, 'stdlib' or hf:NAME; the loss is on completions only)")
    if qcfg.calib_batches < 1:
        raise ConfigError(f"quantize.calib_batches {qcfg.calib_batches} must be >= 1")
    if qcfg.scales not in QAT_SCALES:
        raise ConfigError(f"quantize.scales {qcfg.scales!r}: use one of {list(QAT_SCALES)}")
    if qcfg.scale_init not in SCALE_INITS:
        raise ConfigError(f"quantize.scale_init {qcfg.scale_init!r}: use one of {list(SCALE_INITS)}")
    if not qcfg.scale_lr > 0:
        raise ConfigError(f"quantize.scale_lr {qcfg.scale_lr} must be > 0 (a multiple of optim.lr)")
    clip_ratios(qcfg.clip_grid, qcfg.clip_max_shrink)
    src = Path(ckpt)
    mcfg = read_release_config(src)
    _check_unquantized(src)
    qc = make_quantization_config(qcfg.method, qcfg.group_size, qcfg.modules, qcfg.mode)
    with torch.device("meta"):
        check_targets(K3Model(mcfg), qc)  # group sizes, tied head, something to quantize
    return mcfg, qc


@torch.no_grad()
def _val_loss(model, batches, device, autocast) -> float:
    """Mean next-token CE over the counted targets of the validation batches."""
    model.eval()
    total, count = 0.0, 0
    for tokens, mask in batches:
        tokens, mask = tokens.to(device), mask.to(device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            ce = lm_losses(model, tokens, mask, with_mtp=False)["ce"].item()
        n = int(mask.sum())
        total, count = total + ce * n, count + n
    return total / max(count, 1)


def _calibrate(model, qc: dict, qcfg: QuantizeConfig, calib: BatchLoader, device, autocast, console
               ) -> tuple[dict[str, torch.Tensor], dict]:
    """The calibrated clipping of `model`'s selected int4 weights on qcfg.calib_batches batches of `calib`
    (k3.train.calibrate): ({weight name: scales}, summary)."""
    from rich.progress import Progress

    rec = GramRecorder(model, qc)
    with rec, Progress(console=console, transient=True) as prog, torch.no_grad():
        task = prog.add_task("calibrating", total=qcfg.calib_batches)
        for tokens, _mask in calib.take(qcfg.calib_batches):
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                model(tokens[:, :-1].to(device))
            prog.advance(task)
    return calibrated_scales(model, qc, rec.grams, clip_ratios(qcfg.clip_grid, qcfg.clip_max_shrink))


def _quantized_model(cfg: ModelConfig, qsd: dict, qc: dict, device):
    return instantiate(lambda: apply_quantization(K3Model(cfg), qc), qsd, device=device).eval()


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def run_ptq(cfg: Any, *, ckpt: str | Path, run_dir: Path, run_config: dict | None = None,
            console=None) -> QuantizeResult:
    """Post-training quantization of `ckpt` into RUN_DIR/final (module docstring). `cfg` carries the sections
    quantize, data, train (device, dtype, batch_size, eval_batches, threads)."""
    console = console or make_console()
    qcfg, tcfg = cfg.quantize, cfg.train
    src, run_dir = Path(ckpt), Path(run_dir)
    mcfg, qc = check_request(qcfg, src)
    if (run_dir / "final").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(f"{run_dir} already holds a run; choose another --out")
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = resolve_device(tcfg.device)
    autocast = resolve_autocast(tcfg.dtype, device)
    _, sd = load_release(src)
    losses: dict[str, float] = {}
    stats: dict[str, Any] = {"algorithm": "rtn"}
    scales = None
    if qcfg.data:
        dcfg = dataclasses.replace(cfg.data, source=qcfg.data, tokenizer=str(src / "tokenizer.json"))
        data = prepare_data(dcfg, mcfg.vocab_size, console=console)
        calib = BatchLoader(data.train, seq_len=dcfg.seq_len, batch_size=tcfg.batch_size, seed=dcfg.seed)
        val = BatchLoader(data.val, seq_len=dcfg.seq_len, batch_size=tcfg.batch_size, mode="val")
        val_batches = val.take(tcfg.eval_batches)
        model, _ = load_model(src, device=device, dtype=torch.float32)
        losses["source"] = _val_loss(model, val_batches, device, autocast)
        rtn_sd, _ = quantize_state_dict(sd, mcfg, qcfg.method, qcfg.group_size, qcfg.modules)
        losses["rtn"] = _val_loss(_quantized_model(mcfg, rtn_sd, qc, device), val_batches, device, autocast)
        if qc["group_size"]:  # int4: search the clipping; w8a16 is per channel, RTN only
            scales, summary = _calibrate(model, qc, qcfg, calib, device, autocast, console)
            cal_sd, _ = quantize_state_dict(sd, mcfg, qcfg.method, qcfg.group_size, qcfg.modules, scales=scales)
            losses["calibrated"] = _val_loss(_quantized_model(mcfg, cal_sd, qc, device), val_batches, device,
                                             autocast)
            stats = {"algorithm": "calibrated", "calibration_tokens": qcfg.calib_batches * tcfg.batch_size
                     * dcfg.seq_len, **summary}
        del model
    stats["val_loss"] = losses
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if (src / "tokenizer.json").is_file():
            (run_dir / "tokenizer").mkdir(exist_ok=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (src / f).is_file():
                    shutil.copyfile(src / f, run_dir / "tokenizer" / f)
        rc = {**(run_config or {}), "source": str(src), "quantization_config": qc, "stats": stats}
        _write_text(run_dir / "run_config.yaml", yaml.safe_dump(rc, sort_keys=False))
        _write_text(run_dir / "metrics.jsonl", "".join(json.dumps({"eval": k, "val_loss": v}) + "\n"
                                                       for k, v in losses.items()))
        final = quantize_release(src, run_dir / "final", qcfg.method, qcfg.group_size, modules=qcfg.modules,
                                 scales=scales, run_info={"quantization": stats, "run_config": rc})
    except BaseException:
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    _report(console, losses, stats, final)
    return QuantizeResult(run_dir, final, losses)


def _report(console, losses: dict[str, float], stats: dict, final: Path) -> None:
    if losses:
        line = ", ".join(f"{k} {v:.4f}" for k, v in losses.items())
        console.print(f"validation loss: {line}")
    if "rtn_rel_output_error" in stats:
        console.print(f"calibrated clipping: relative output error {stats['rtn_rel_output_error']:.4f} (RTN) -> "
                      f"{stats['calibrated_rel_output_error']:.4f} on {stats['calibration_tokens']:,} tokens")
    console.print(f"[bold green]done[/]: quantized release {final}")


def run_qat(cfg: Any, *, ckpt: str | Path, run_dir: Path, resume: bool = False, run_config: dict | None = None,
            console=None) -> QuantizeResult:
    """Quantization-aware fine-tuning of `ckpt` through `k3 pretrain`'s run, then conversion (module docstring).
    `cfg` carries the sections quantize, data, optim, train, ckpt."""
    from .pretrain import run as pretrain_run

    qcfg = cfg.quantize
    src = Path(ckpt)
    mcfg, qc = check_request(qcfg, src)
    if not resume and (Path(run_dir) / "final").exists():
        raise ConfigError(f"{run_dir} already holds a finished run; choose another --out")
    run_cfg = dataclasses.replace(cfg, model=mcfg, data=dataclasses.replace(cfg.data, source=qcfg.data))
    learned = qcfg.scales == "learned" and qc["group_size"] is not None  # w8a16 keeps per-channel absmax
    qat_info: dict[str, Any] = {"scales": "learned" if learned else "absmax"}
    init_scales = None
    if learned:
        qat_info.update(scale_init=qcfg.scale_init, scale_lr=qcfg.scale_lr)
    if learned and qcfg.scale_init == "calibrated" and not resume:  # a resumed run reads its scales back
        init_scales, summary = _calibrate_source(cfg, src, mcfg, qc, console or make_console())
        qat_info["calibration"] = summary

    def prepare(model) -> None:
        enable_fake_quant(model, qc, scales=qat_info["scales"], init_scales=init_scales, scale_lr=qcfg.scale_lr)

    def release(model) -> tuple[dict, dict]:
        # absmax: the fake quantizer's scales are these weights' absmax, recomputed the same way here; learned:
        # the trained scale parameters themselves
        sd, scales = pop_learned_scales({k: v.detach().cpu() for k, v in model.state_dict().items()})
        return quantize_state_dict(sd, mcfg, qc["format"], qc["group_size"], qcfg.modules, "qat",
                                   scales=scales or None)

    rc = {**(run_config or {}), "source": str(src), "quantization_config": qc, "qat": qat_info}
    res = pretrain_run(run_cfg, run_dir=Path(run_dir), resume=resume, init=str(src), run_config=rc,
                       console=console, command=f"k3 quantize {src} --mode qat", prepare_model=prepare,
                       release_state=release)
    losses = {} if res.val_loss is None else {"qat": res.val_loss}
    return QuantizeResult(res.run_dir, res.final_dir, losses, res.stop_signal)


def _calibrate_source(cfg: Any, src: Path, mcfg: ModelConfig, qc: dict, console) -> tuple[dict, dict]:
    """Calibrated clipping of the source release on its data (as ptq does), for QAT's learned-scale init."""
    tcfg = cfg.train
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = resolve_device(tcfg.device)
    dcfg = dataclasses.replace(cfg.data, source=cfg.quantize.data, tokenizer=str(src / "tokenizer.json"))
    data = prepare_data(dcfg, mcfg.vocab_size, console=console)
    calib = BatchLoader(data.train, seq_len=dcfg.seq_len, batch_size=tcfg.batch_size, seed=dcfg.seed)
    model, _ = load_model(src, device=device, dtype=torch.float32)
    scales, summary = _calibrate(model, qc, cfg.quantize, calib, device, resolve_autocast(tcfg.dtype, device),
                                 console)
    console.print(f"calibrated clipping for the initial scales: relative output error "
                  f"{summary['rtn_rel_output_error']:.4f} (RTN) -> {summary['calibrated_rel_output_error']:.4f}")
    return {k: v.cpu() for k, v in scales.items()}, {k: v for k, v in summary.items() if k != "clip_ratios"}


def run(cfg: Any, *, ckpt: str | Path, run_dir: Path, resume: bool = False, run_config: dict | None = None,
        console=None) -> QuantizeResult:
    """`k3 quantize` (module docstring): ptq or qat by cfg.quantize.mode."""
    if cfg.quantize.mode == "qat":
        return run_qat(cfg, ckpt=ckpt, run_dir=run_dir, resume=resume, run_config=run_config, console=console)
    if resume:
        raise ConfigError("--resume continues a qat run; ptq has no training to resume (run it again without "
                          "--resume into a new --out)")
    return run_ptq(cfg, ckpt=ckpt, run_dir=run_dir, run_config=run_config, console=console)
