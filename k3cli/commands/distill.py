"""`k3 distill --student CKPT --teacher NAME=CKPT... --prompts FILE.jsonl --out RUN_DIR`: parse flags -> K3Config
-> k3.train.distill.run (with k3.serve's batched generation passed in)."""

from __future__ import annotations

from pathlib import Path

import typer

from k3.cli.config import apply_kernels, config_dict, environment_info, resolve_config, resume_config_files
from k3.cli.errors import friendly_errors


def parse_teachers(specs: list[str]) -> dict[str, str]:
    """["code=runs/code/final", ...] -> {"code": "runs/code/final"}; BadParameter on a malformed or repeated NAME."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"{spec!r}: expected NAME=CKPT, e.g. --teacher code=runs/code/final",
                                     param_hint="--teacher")
        if name in out:
            raise typer.BadParameter(f"teacher name {name!r} is given twice", param_hint="--teacher")
        out[name] = path
    return out


@friendly_errors
def distill(
    student: Path = typer.Option(..., "--student", help="release checkpoint the student starts from (e.g. "
                                 "runs/tiny/final); final/ is the distilled student"),
    teacher: list[str] = typer.Option(..., "--teacher", "-t", help="NAME=CKPT: a teacher release sharing the "
                                      "student's tokenizer (made with k3 pretrain --init STUDENT --preset sft); "
                                      "repeatable"),
    prompts: Path = typer.Option(..., "--prompts", help="JSONL: {\"prompt\": TEXT} or {\"messages\": [...]} per "
                                 "line, optional \"teacher\": NAME to route it (others follow distill.routing)"),
    out: Path = typer.Option(..., "--out", "-o", help="run directory: run_config.yaml, metrics.jsonl, tokenizer/, "
                             "checkpoints/, final/"),
    preset: str = typer.Option("default", "--preset", "-p", help="distill preset: default (runs/tiny/final on 2 CPU "
                               "cores, minutes), small (k3-small, one GPU)"),
    config: list[Path] | None = typer.Option(None, "--config", "-c", help="YAML file of sections (distill:, optim:, "
                                             "train:, ckpt:) merged over the preset; repeatable"),
    set_: list[str] | None = typer.Option(None, "--set", "-s", help="override one field, e.g. --set "
                                          "distill.loss=jsd --set distill.beta=0.5 --set train.max_steps=200; "
                                          "repeatable"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out exactly where it stopped (same "
                                "student, teachers and prompts)"),
) -> None:
    """On-policy distillation of one student from several teachers: each step the student samples completions
    of routed prompts, each teacher scores the tokens routed to it, and the student follows the per-token reverse
    KL (or sampled_reverse_kl, forward_kl, jsd: --set distill.loss=...). Per-teacher reverse KL, log-probs and
    sample lengths go to metrics.jsonl.

    k3 distill --student runs/tiny/final --teacher code=runs/code/final --teacher prose=runs/prose/final
    --prompts prompts.jsonl --out runs/distill
    """
    from k3.serve.generate import generate_batch
    from k3.train.distill import run

    teachers = parse_teachers(teacher)
    files, from_saved = resume_config_files(out, [str(p) for p in config or []], resume)
    cfg = resolve_config("distill", preset=None if from_saved else preset, config_files=files, sets=list(set_ or []))
    rc = {"command": "distill", "preset": preset, "config": config_dict(cfg), "kernels": apply_kernels(cfg),
          "env": environment_info()}
    command = " ".join(["k3 distill", f"--student {student}", *(f"--teacher {t}" for t in teacher),
                        f"--prompts {prompts}"])
    res = run(cfg, student=student, teachers=teachers, prompts=prompts, run_dir=out, generate=generate_batch,
              resume=resume, run_config=rc, command=command)
    if res.stop_signal is not None:
        raise typer.Exit(code=128 + res.stop_signal)  # 130 / 143, as k3 pretrain
