"""`k3 quantize CKPT --out RUN_DIR`: parse flags -> K3Config -> k3.train.quantize.run."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from k3.cli.config import apply_kernels, config_dict, environment_info, resolve_config
from k3.cli.errors import friendly_errors


@friendly_errors
def quantize(
    ckpt: Path = typer.Argument(..., help="the bf16 / fp32 release checkpoint to quantize (e.g. runs/tiny/final)"),
    out: Path = typer.Option(..., "--out", "-o", help="run directory: run_config.yaml, metrics.jsonl, tokenizer/, "
                             "checkpoints/ (qat), final/ (the quantized release)"),
    method: str | None = typer.Option(None, "--method", help="w4a8 (default: int4 weights in groups, per-token FP8 "
                                      "activations) | w4a16 (int4 weights) | w8a16 (int8 weights per channel)"),
    group_size: int | None = typer.Option(None, "--group-size", help="int4 group along the in-features: 16 | 32 "
                                          "(default) | 64 | 128; must divide every selected tensor's in-features"),
    mode: str | None = typer.Option(None, "--mode", help="ptq (default: round-to-nearest; with --data, clipping "
                                    "calibrated on the output error) | qat (fake-quant fine-tune on --data with "
                                    "int4 scales learned from the calibrated clipping, then convert)"),
    modules: str | None = typer.Option(None, "--modules", help="routed_experts (default) | experts (+ shared "
                                       "experts) | all_linear (+ attention projections, dense MLP, MTP, LM head)"),
    data: str | None = typer.Option(None, "--data", help="text for calibration (ptq) or fine-tuning (qat): "
                                    "'stdlib', a .txt/.jsonl/.parquet path or glob (prompt/completion JSONL trains "
                                    "on completions only), or hf:NAME"),
    preset: str = typer.Option("default", "--preset", "-p", help="quantize preset: default (the CPU checkpoint "
                               "runs/tiny/final: QAT of 60 steps in minutes on 2 cores), small (k3-small, one GPU)"),
    config: list[Path] | None = typer.Option(None, "--config", "-c", help="YAML file of sections (quantize:, data:, "
                                             "optim:, train:, ckpt:) merged over the preset; repeatable"),
    set_: list[str] | None = typer.Option(None, "--set", "-s", help="override one field, e.g. --set "
                                          "train.max_steps=200 --set quantize.calib_batches=16; repeatable"),
    resume: bool = typer.Option(False, "--resume", help="continue the qat run in --out exactly where it stopped"),
) -> None:
    """Quantize a release checkpoint: post-training (RTN, optionally calibrated) or quantization-aware fine-tuning
    with k3 pretrain's loop. final/ is a quantized release that k3 generate and k3 serve load; the flags are
    shortcuts for quantize: fields. Formats and layout: model/README.md "Quantized release checkpoints".

    RTN of the routed experts: k3 quantize runs/tiny/final --out runs/tiny-w4a8

    Calibrated clipping: k3 quantize runs/tiny/final --out runs/tiny-ptq --data stdlib

    QAT, then conversion: k3 quantize runs/tiny/final --out runs/tiny-qat --mode qat --data stdlib

    QAT on absmax scales instead of learned ones: add --set quantize.scales=absmax (quantize.scale_init,
    quantize.scale_lr: how learned scales start and train)
    """
    from k3.train.quantize import run

    flags = {"method": method, "group_size": group_size, "mode": mode, "modules": modules, "data": data}
    overrides = {"quantize": {k: v for k, v in flags.items() if v is not None}}
    files = [str(p) for p in config or []]
    saved = out / "run_config.yaml"
    if resume and saved.is_file():
        # the saved resolved config wins over the preset, so the resumed run trains the same thing
        prev = yaml.safe_load(saved.read_text()) or {}
        tmp = out / ".resume_config.yaml"
        tmp.write_text(yaml.safe_dump(prev.get("config", {})))
        files = [str(tmp)] + files
    cfg = resolve_config("quantize", preset=None if resume and saved.is_file() else preset, config_files=files,
                         overrides=overrides, sets=list(set_ or []))
    rc = {"command": "quantize", "preset": preset, "config": config_dict(cfg), "kernels": apply_kernels(cfg),
          "env": environment_info(), "init": str(ckpt)}
    res = run(cfg, ckpt=ckpt, run_dir=out, resume=resume, run_config=rc)
    if res.stop_signal is not None:
        raise typer.Exit(code=128 + res.stop_signal)  # 130 / 143, as k3 pretrain
