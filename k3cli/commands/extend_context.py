"""`k3 extend-context CKPT --seq-len N`: parse flags -> K3Config -> k3.train.extend.run."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from k3.cli.config import apply_kernels, config_dict, environment_info, resolve_config
from k3.cli.errors import friendly_errors


@friendly_errors
def extend_context(
    ckpt: Path = typer.Argument(..., help="the checkpoint to extend: a release (RUN_DIR/final) or a training "
                                "checkpoint (RUN_DIR/checkpoints/step-N) of k3 pretrain or k3 extend-context"),
    seq_len: int = typer.Option(..., "--seq-len", min=2, help="the new training sequence length (data.seq_len); "
                                "must be above the length the checkpoint was trained at"),
    out: Path = typer.Option(..., "--out", "-o", help="run directory: run_config.yaml, metrics.jsonl, "
                             "checkpoints/, final/ (as k3 pretrain)"),
    position: str = typer.Option("nope", "--position", help="nope (default, the K3 recipe: the MLA layers drop "
                                 "RoPE; KDA carries position) | rope (keep RoPE: the baseline)"),
    rope_theta: float | None = typer.Option(None, "--rope-theta", help="with --position rope: a new RoPE base, "
                                            "e.g. 4x the parent's model.rope_theta for 4x the length"),
    preset: str = typer.Option("tiny", "--preset", "-p", help="extend preset: tiny (the CPU default checkpoint, "
                               "256 -> 1024 tokens in minutes on 2 cores), small (k3-small on one GPU)"),
    config: list[Path] | None = typer.Option(None, "--config", "-c", help="YAML file of sections (data:, optim:, "
                                             "train:, ckpt:) merged over the preset; repeatable"),
    set_: list[str] | None = typer.Option(None, "--set", "-s", help="override one field, e.g. --set "
                                          "train.max_steps=100 --set data.passkey_fraction=0.2; repeatable"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out exactly where it stopped"),
) -> None:
    """Extend a pretrained model's context: load CKPT, set its MLA position mode (NoPE by default) and keep
    training at --seq-len with k3 pretrain's loop, optimiser, checkpoints and resume. The data are long documents
    (the stdlib source packs whole files back to back) with synthetic passkey documents mixed in
    (data.passkey_fraction, 0.1 in the presets). final/config.json records the new mla_position and the trained
    length (max_position_embeddings); k3_run.yaml names the parent. Then measure it with k3 eval passkey and
    k3 eval loss.

    Example: k3 extend-context runs/tiny/final --seq-len 1024 --out runs/tiny-nope-1k
    """
    from k3.train.extend import model_overrides, run

    sets = list(set_ or [])
    files = [str(p) for p in config or []]
    saved = out / "run_config.yaml"
    overrides: dict = {"data": {"seq_len": seq_len}}
    if resume and saved.is_file():
        # the saved resolved config wins over the preset and the parent, so the resumed run trains the same thing
        prev = yaml.safe_load(saved.read_text()) or {}
        tmp = out / ".resume_config.yaml"
        tmp.write_text(yaml.safe_dump(prev.get("config", {})))
        files = [str(tmp)] + files
    else:
        overrides["model"] = model_overrides(ckpt, position=position, rope_theta=rope_theta)
    cfg = resolve_config("extend-context", preset=None if resume and saved.is_file() else preset,
                         config_files=files, overrides=overrides, sets=sets)
    rc = {"command": "extend-context", "preset": preset, "config": config_dict(cfg), "kernels": apply_kernels(cfg),
          "env": environment_info(), "init": str(ckpt)}
    # a resumed run was checked when it started (a nope parent forced to stay nope needs no second --set)
    forced = any(s.replace(" ", "").startswith("model.mla_position=") for s in sets) or (resume and saved.is_file())
    res = run(cfg, ckpt=ckpt, run_dir=out, resume=resume, position_forced=forced, run_config=rc)
    if res.stop_signal is not None:
        raise typer.Exit(code=128 + res.stop_signal)  # 130 / 143, as k3 pretrain
