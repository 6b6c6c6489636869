"""`k3 pretrain`: parse flags -> K3Config -> k3.train.pretrain.run."""

from __future__ import annotations

import os
from pathlib import Path

import typer
import yaml

from k3.cli.config import apply_kernels, config_dict, environment_info, resolve_config
from k3.cli.errors import friendly_errors


@friendly_errors
def pretrain(
    preset: str = typer.Option("tiny", "--preset", "-p",
                               help="pretrain preset: debug (<60 s on 2 cores), tiny (default, <=10 min on 2 cores), "
                                    "small (one GPU), sft (fine-tune --init CKPT on prompt/completion or messages "
                                    "JSONL: how to make k3 distill's teachers)"),
    config: list[Path] | None = typer.Option(None, "--config", "-c",
                                                help="YAML file of sections (model:, data:, optim:, train:, ckpt:) "
                                                     "merged over the preset; repeatable"),
    set_: list[str] | None = typer.Option(None, "--set", "-s",
                                             help="override one field, e.g. --set train.max_steps=200 "
                                                  "--set data.source='~/text/*.txt'; repeatable"),
    out: Path | None = typer.Option(None, "--out", "-o", help="run directory (default runs/<timestamp>)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out exactly where it stopped"),
    init: Path | None = typer.Option(None, "--init",
                                        help="start from a release checkpoint's weights (continued pretraining)"),
) -> None:
    """Pretrain a K3 model. With no arguments: k3-tiny on the Python standard library, ~10 min on a 2-core CPU.

    The run directory receives run_config.yaml, metrics.jsonl, checkpoints/step-N/ and the release checkpoint
    final/ that `k3 generate` and `k3 serve` load.
    """
    from k3.cli.config import read_preset
    from k3.train.pretrain import default_run_dir, read_init, run

    run_dir = out or default_run_dir()
    files = [str(p) for p in config or []]
    saved = run_dir / "run_config.yaml"
    if resume:
        if out is None:
            raise typer.BadParameter("--resume needs --out RUN_DIR (the run to continue)")
        if saved.is_file():
            # the saved resolved config wins over the preset so the resumed run trains the same thing
            prev = yaml.safe_load(saved.read_text()) or {}
            tmp = run_dir / ".resume_config.yaml"
            part = tmp.with_name(f"{tmp.name}.{os.getpid()}")  # every rank of a multi-process run writes it
            part.write_text(yaml.safe_dump(prev.get("config", {})))
            os.replace(part, tmp)
            files = [str(tmp)] + files
    from_saved = resume and saved.is_file()
    overrides, weights = None, None
    if not from_saved and "model" not in read_preset("pretrain", preset):
        # a fine-tuning preset (sft) keeps the --init checkpoint's architecture and sequence length
        if init is None:
            raise typer.BadParameter(f"--preset {preset} fine-tunes a checkpoint: pass --init CKPT (e.g. "
                                     f"runs/tiny/final)", param_hint="--init")
        weights = read_init(init)
        overrides = {"model": weights.cfg.to_dict()}
        if weights.trained_seq_len:
            overrides["data"] = {"seq_len": weights.trained_seq_len}
    cfg = resolve_config("pretrain", preset=None if from_saved else preset, config_files=files, overrides=overrides,
                         sets=list(set_ or []))
    rc = {"command": "pretrain", "preset": preset, "config": config_dict(cfg), "kernels": apply_kernels(cfg),
          "env": environment_info(), "init": None if init is None else str(init)}
    res = run(cfg, run_dir=run_dir, resume=resume, init=weights or (None if init is None else str(init)),
              run_config=rc)
    if res.stop_signal is not None:
        # 128 + N, the status of a process killed by signal N, so that `k3 pretrain ... && next` stops after Ctrl-C
        # (130) or SIGTERM (143); the checkpoint and the resume command are written by then
        raise typer.Exit(code=128 + res.stop_signal)
