"""`k3 ablate`: run the suites of k3.train.ablate_suites (one per claim of the K3 report) through the normal
commands' entry points and write OUT/report.md (k3.train.ablate_report; docs/ablate.md).

Layout: OUT/SUITE/ARM/seed-S/ is an ordinary run directory of `k3 pretrain` (or `k3 extend-context`), plus
glu_max.jsonl (c2glu: the running max |h| of the GLU intermediates, one line per evaluation) and passkey/ (the
`k3 eval passkey` result of the arms that read it). Runs go one at a time: a finished run (final/ and the same
recorded config) is skipped, an interrupted one (a training checkpoint) resumed with `resume=True`, a directory
holding another config is an error naming it.

k3.train may not import k3.cli or k3.serve, so the caller passes `resolve(command, preset, sets, overrides)` (the
config resolver) and `generate_batch` (k3.serve.generate.generate_batch, for passkey).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from k3.model.config import config_to_dict

# imported here, not in _train: extend binds pretrain.run at its import, which must be the real one (a test that
# replaces pretrain.run would otherwise leave its stub inside extend for the rest of the process)
from . import ablate_opd, distill, extend, pretrain, quantize
from .ablate_suites import SCALES, SUITES, AblateError, PlannedRun, Scale, Suite, expand_sets

__all__ = ["AblateError", "GluMaxRecorder", "list_lines", "plan", "run_suites"]

GLU_FILE = "glu_max.jsonl"
PASSKEY_DIR = "passkey"
LOSS_DIR = "loss"


# ---------------------------------------------------------------------------------------------------- planning


def check_names(names: list[str], scale: str) -> list[Suite]:
    if scale not in SCALES:
        raise AblateError(f"--scale {scale!r}: use one of {', '.join(SCALES)}")
    if not names:
        raise AblateError(f"name at least one suite: {', '.join(SUITES)} (k3 ablate --list)")
    bad = [n for n in names if n not in SUITES]
    if bad:
        raise AblateError(f"unknown suite {', '.join(map(repr, bad))}; valid names: {', '.join(SUITES)}")
    suites = [SUITES[n] for n in dict.fromkeys(names)]
    unwired = [s.name for s in suites if not s.wired]
    if unwired:
        raise AblateError(f"suite(s) {', '.join(unwired)} are not wired yet ({SUITES[unwired[0]].note}); the wired "
                          f"ones: {', '.join(n for n, s in SUITES.items() if s.wired)}")
    return suites


def base_sets(scale: Scale, suite: Suite, seed: int, *, extend_batch: int | None = None,
              quantize: bool = False) -> list[str]:
    """The --set list every arm of `suite` shares at `scale` and seed index `seed` (the arm's own come after);
    extend_batch: an extend-context child's (its train.batch_size, or 0 for the preset's)."""
    if quantize:
        return [*scale.extra_sets, f"train.max_steps={scale.quantize_steps}", f"ckpt.every={scale.quantize_steps}",
                f"train.seed={seed}"]
    if extend_batch is not None:
        return [*scale.extra_sets, f"data.seq_len={scale.extend_seq_len}", f"train.max_steps={scale.extend_steps}",
                f"ckpt.every={scale.extend_steps}", f"train.seed={seed}"] \
            + ([f"train.batch_size={extend_batch}"] if extend_batch else [])
    return [*scale.extra_sets, f"train.max_steps={scale.steps}", f"train.eval_every={scale.eval_every}",
            f"ckpt.every={scale.eval_every}", f"train.seed={seed}", *suite.base_sets]


def plan(suites: list[Suite], scale: Scale, seeds: int, out: Path, resolve: Callable) -> list[PlannedRun]:
    """Every run of the suites, parents before their children; the --set lists are resolved (placeholders) from
    the scale's base model. Nothing is run or written."""
    if seeds < 1:
        raise AblateError(f"--seeds {seeds}: need at least one seed")
    base = resolve("pretrain", scale.preset, list(scale.extra_sets), None)
    model = config_to_dict(base.model)
    tokens = base.train.batch_size * base.train.grad_accum * base.data.seq_len
    ext_batch = max(1, tokens // (base.train.grad_accum * scale.extend_seq_len)) if scale.extend_keep_tokens else 0
    ft_sets = finetune_sets(resolve("quantize", scale.quantize_preset, list(scale.extra_sets), None))
    runs = []
    for suite in suites:
        for arm in suite.arms:
            for s in range(seeds):
                rd = Path(out) / suite.name / arm.label / f"seed-{s}"
                if arm.command == "distill":
                    sets = distill_sets(scale, s)
                elif arm.command == "finetune" and arm.budget == "distill":
                    sets = sft_arm_sets(scale, s, rd, arm, resolve)
                else:
                    eb = ext_batch if arm.command == "extend-context" else None
                    sets = (base_sets(scale, suite, s, extend_batch=eb,
                                      quantize=arm.command in ("quantize", "finetune"))
                            + (ft_sets if arm.command == "finetune" else []))
                runs.append(PlannedRun(suite, arm, s, rd, sets + expand_sets(arm.sets, model, scale)))
    order = {(su.name, a.label): i for su in suites for i, a in enumerate(su.arms)}

    def depth(su: Suite, label: str) -> int:  # parents (and teachers) before their children
        arm = next(a for a in su.arms if a.label == label)
        return max([0] + [1 + depth(su, x) for x in (arm.parent, arm.teacher) if x is not None])

    return sorted(runs, key=lambda r: (suites.index(r.suite), depth(r.suite, r.arm.label),
                                       order[(r.suite.name, r.arm.label)], r.seed))


def distill_sets(scale: Scale, seed: int) -> list[str]:
    """The opd arm's k3 distill --set list: the scale's student budget on top of the distill preset (the scale's
    extra sets of the sections k3 distill reads)."""
    own = ("train", "optim", "ckpt", "distill")
    return [*(x for x in scale.extra_sets if x.split(".", 1)[0] in own), f"train.max_steps={scale.opd_steps}",
            f"ckpt.every={scale.opd_steps}", f"train.seed={seed}", f"train.batch_size={scale.opd_batch}",
            f"distill.max_new_tokens={scale.opd_new_tokens}"]


def sft_arm_sets(scale: Scale, seed: int, run_dir: Path, arm: Any, resolve: Callable) -> list[str]:
    """The sft arm's k3 pretrain --init --set list: the opd arm's steps, batch and optimizer (ablate_opd.sft_sets),
    trained on the samples of the teacher of the same seed."""
    dist = resolve("distill", scale.opd_preset, distill_sets(scale, seed), None)
    base = [*scale.extra_sets, f"train.max_steps={scale.opd_steps}", f"train.eval_every={scale.opd_steps}",
            f"ckpt.every={scale.opd_steps}", f"train.seed={seed}"]
    samples = ablate_opd.samples_path(Path(run_dir).parent.parent / arm.teacher / f"seed-{seed}")
    # the optimizer fields that differ are read from the pretrain base (the data and train sets leave optim as is)
    return base + ablate_opd.sft_sets(dist, resolve("pretrain", scale.preset, base, None), scale, samples)


def finetune_sets(qcfg: Any) -> list[str]:
    """The qat suite's bf16 fine-tune trains with QAT's optimizer and batch settings (the quantize preset's)."""
    o, t, d = qcfg.optim, qcfg.train, qcfg.data
    return [f"optim.lr={o.lr:g}", f"optim.schedule={o.schedule}", f"optim.min_lr_ratio={o.min_lr_ratio:g}",
            f"optim.warmup_steps={'null' if o.warmup_steps is None else o.warmup_steps}",
            f"train.batch_size={t.batch_size}", f"train.grad_accum={t.grad_accum}", f"train.eval_every={t.eval_every}",
            f"train.eval_batches={t.eval_batches}", f"data.seq_len={d.seq_len}"]


def parent_dir(r: PlannedRun) -> Path:
    return Path(r.run_dir).parent.parent / r.arm.parent / f"seed-{r.seed}" / "final"


def teacher_dir(r: PlannedRun) -> Path:
    """The run directory of run r's teacher arm (same seed)."""
    return Path(r.run_dir).parent.parent / r.arm.teacher / f"seed-{r.seed}"


def suite_dir(r: PlannedRun) -> Path:
    return Path(r.run_dir).parent.parent


def extend_overrides(r: PlannedRun, scale: Scale) -> dict:
    """The extend-context child's model section: the parent's model with the arm's position (its length and batch
    are --set entries of the plan)."""
    from .extend import model_overrides

    parent = parent_dir(r)
    if not (parent / "config.json").is_file():
        raise AblateError(f"{r.run_dir}: its parent {parent} is missing; run the suite from its parent arm "
                          f"(k3 ablate {r.suite.name} ...)")
    return {"model": model_overrides(parent, position=r.arm.position, rope_theta=None)}


def resolve_run(r: PlannedRun, scale: Scale, resolve: Callable) -> Any:
    if r.arm.command == "quantize":
        return resolve("quantize", scale.quantize_preset, r.sets, None)
    if r.arm.command == "extend-context":
        return resolve("extend-context", scale.extend_preset, r.sets, extend_overrides(r, scale))
    if r.arm.command == "distill":
        return resolve("distill", scale.opd_preset, r.sets, None)
    return resolve("pretrain", scale.preset, r.sets, None)


def plain_config(cfg: Any) -> dict:
    """The resolved config as run_config.yaml stores it (None sections dropped, YAML round trip)."""
    return yaml.safe_load(yaml.safe_dump({k: v for k, v in config_to_dict(cfg).items() if v is not None}))


def command_line(r: PlannedRun, scale: Scale) -> str:
    """The `k3 pretrain` / `k3 extend-context` command that trains run r alone (shell-quoted)."""
    if r.arm.command == "extend-context":
        args = ["k3", "extend-context", str(parent_dir(r)), "--preset", scale.extend_preset, "--seq-len",
                str(scale.extend_seq_len), "--position", str(r.arm.position)]
    elif r.arm.command == "finetune":
        args = ["k3", "pretrain", "--preset", scale.preset, "--init", str(parent_dir(r))]
    elif r.arm.command == "quantize":
        args = ["k3", "quantize", str(parent_dir(r)), "--preset", scale.quantize_preset]
    elif r.arm.command == "distill":
        args = ["k3", "distill", "--student", str(parent_dir(r)), "--teacher",
                f"{ablate_opd.TEACHER}={teacher_dir(r) / 'final'}", "--prompts",
                str(ablate_opd.prompts_path(suite_dir(r), "train")), "--preset", scale.opd_preset]
    else:
        args = ["k3", "pretrain", "--preset", scale.preset]
    for s in r.sets:
        args += ["--set", s]
    return shlex.join(args + ["--out", str(r.run_dir)])


def ablate_command(names: list[str], scale: str, seeds: int, out: Path, resume: bool = False) -> str:
    return shlex.join(["k3", "ablate", *names, "--scale", scale, "--seeds", str(seeds), "--out", str(out)]
                      + (["--resume"] if resume else []))


# ---------------------------------------------------------------------------------------------------- state


def is_finished(run_dir: Path) -> bool:
    """final/config.json and run_config.yaml, with the final evaluation recorded (stats.final_val_loss), for a
    k3 quantize release (ptq has no training) its quantization_config, for a k3 distill run (no evaluation) its
    final step count (stats.steps)."""
    rc = run_dir / "run_config.yaml"
    if not (rc.is_file() and (run_dir / "final" / "config.json").is_file()):
        return False
    saved = yaml.safe_load(rc.read_text()) or {}
    stats = saved.get("stats") or {}
    return (stats.get("final_val_loss") is not None or "quantization_config" in saved
            or ("teachers" in saved and stats.get("steps") is not None))


def run_state(run_dir: Path) -> str:
    """'finished' (is_finished), 'interrupted' (a training checkpoint) or 'new'."""
    if is_finished(run_dir):
        return "finished"
    ck = run_dir / "checkpoints"
    if ck.is_dir() and any(c.name.startswith("step-") for c in ck.iterdir()):
        return "interrupted"
    return "new"


def check_saved_config(run_dir: Path, config: dict) -> None:
    """AblateError when run_dir's run_config.yaml records another config than `config`."""
    rc = run_dir / "run_config.yaml"
    if not rc.is_file():
        return
    saved = (yaml.safe_load(rc.read_text()) or {}).get("config")
    if saved != config:
        diff = sorted(f"{s}.{k}" for s in config for k in (config[s] or {})
                      if ((saved or {}).get(s) or {}).get(k) != config[s][k])
        raise AblateError(f"{run_dir} holds a run with a different config ({', '.join(diff[:6]) or 'sections'}); "
                          f"use another --out, or delete {run_dir} to retrain it")


# ---------------------------------------------------------------------------------------------------- GLU hook


class GluMaxRecorder:
    """Running max |h| of every GLU intermediate (the input of each down projection: GatedMLP's down_proj, the
    routed experts' down matmul via GroupedExperts.input_observer) over training forwards; one line per
    evaluation (the first eval-mode forward after training ones, and the final one) into run_dir/glu_max.jsonl.

    step = training forwards // grad_accum (one forward of the whole model per micro-batch). A resumed run
    continues from the file's last line."""

    def __init__(self, run_dir: Path, grad_accum: int):
        self.path = Path(run_dir) / GLU_FILE
        self.grad_accum = max(1, grad_accum)
        self.max_abs, self.forwards, self.training, self.per_kind = 0.0, 0, True, {}
        if self.path.is_file():
            lines = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
            if lines:
                self.max_abs, self.per_kind = lines[-1]["max_abs_h"], dict(lines[-1].get("per_kind", {}))
                self.forwards = lines[-1]["step"] * self.grad_accum

    def _see(self, kind: str, h: torch.Tensor) -> None:
        if not self.training or h.numel() == 0:
            return
        m = float(h.detach().abs().max())
        self.max_abs = max(self.max_abs, m)
        self.per_kind[kind] = max(self.per_kind.get(kind, 0.0), m)

    def _model_pre(self, module, args) -> None:
        if module.training:
            self.forwards += 1
        elif self.training:  # first evaluation forward after training ones: record the running max
            self._write()
        self.training = module.training

    def _write(self) -> None:
        rec = {"step": self.forwards // self.grad_accum, "max_abs_h": self.max_abs, "per_kind": self.per_kind}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def install(self, model: torch.nn.Module) -> int:
        """Hook every GatedMLP and GroupedExperts of `model`; returns how many were hooked."""
        from k3.model.layers import GatedMLP
        from k3.model.moe import GroupedExperts

        n = 0
        model.register_forward_pre_hook(self._model_pre)
        for name, m in model.named_modules():
            if isinstance(m, GatedMLP):
                kind = "shared" if "shared_experts" in name else ("mtp" if "mtp" in name else "dense")
                m.down_proj.register_forward_pre_hook(lambda mod, args, k=kind: self._see(k, args[0]))
                n += 1
            elif isinstance(m, GroupedExperts):
                if m.input_observer is not None:
                    raise AblateError(f"{name}: its input_observer is taken; the GLU recorder needs it")
                m.input_observer = lambda nm, x, counts: self._see("routed", x) if nm == "down_proj" else None
                n += 1
        if n == 0:
            raise AblateError("the model has no GatedMLP or GroupedExperts to record max |h| from")
        return n


# ---------------------------------------------------------------------------------------------------- running


def _train(r: PlannedRun, cfg: Any, scale: Scale, resume: bool, rc: dict, console,
           generate_batch: Callable | None = None) -> Any:
    """One run through the command's own entry point (looked up at call time, so that tests can replace it)."""
    prepare = None
    if r.suite.glu_hook:
        if not resume:
            (Path(r.run_dir) / GLU_FILE).unlink(missing_ok=True)  # an attempt that stopped before its checkpoint
        rec = GluMaxRecorder(Path(r.run_dir), cfg.train.grad_accum)
        prepare = rec.install
    if r.arm.command == "quantize":
        return quantize.run(cfg, ckpt=parent_dir(r), run_dir=Path(r.run_dir), resume=resume, run_config=rc,
                            console=console)
    if r.arm.command == "distill":
        if generate_batch is None:
            raise AblateError(f"{r.name}: k3 distill needs generate_batch (k3.serve.generate.generate_batch)")
        return distill.run(cfg, student=parent_dir(r), teachers={ablate_opd.TEACHER: teacher_dir(r) / "final"},
                           prompts=ablate_opd.prompts_path(suite_dir(r), "train"), run_dir=Path(r.run_dir),
                           generate=generate_batch, resume=resume, run_config=rc, console=console,
                           command="k3 distill")
    if r.arm.command == "extend-context":
        if prepare is not None:
            raise AblateError("internal: the GLU recorder runs on pretrain arms only")
        return extend.run(cfg, ckpt=parent_dir(r), run_dir=Path(r.run_dir), resume=resume, run_config=rc,
                          console=console)
    init = str(parent_dir(r)) if r.arm.command == "finetune" else None
    return pretrain.run(cfg, run_dir=Path(r.run_dir), resume=resume, run_config=rc, console=console,
                        prepare_model=prepare, command="k3 pretrain", init=init)


def _passkey(r: PlannedRun, scale: Scale, generate_batch: Callable | None, console) -> None:
    from . import evaluate

    out = Path(r.run_dir) / PASSKEY_DIR
    if (out / "passkey.json").is_file():
        return
    if generate_batch is None:
        raise AblateError(f"{r.name}: passkey needs generate_batch (k3.serve.generate.generate_batch)")
    lengths = scale.passkey_lengths if r.arm.command == "extend-context" else scale.hybrid_passkey_lengths
    out.mkdir(parents=True, exist_ok=True)
    evaluate.run_passkey(Path(r.run_dir) / "final", lengths=list(lengths), depths=list(scale.passkey_depths),
                         trials=scale.passkey_trials, seed=r.seed, out=out, generate_batch=generate_batch,
                         device="cuda" if torch.cuda.is_available() else "cpu", console=console)


def _loss_eval(r: PlannedRun, scale: Scale, console) -> None:
    """LOSS_DIR/loss.json of run r's release on the first validation windows of its suite parent's data, the
    same for every arm of the suite (k3 quantize's own losses use other splits per mode)."""
    from k3.model.checkpoint import load_model

    from .data import prepare_data
    from .evaluate import loss_eval, run_data_config, write_json

    out = Path(r.run_dir) / LOSS_DIR
    if (out / "loss.json").is_file():
        return
    final = Path(r.run_dir) / "final"
    ref = parent_dir(r) if r.arm.parent else final
    dcfg = run_data_config(ref)
    model, mcfg = load_model(final, device="cuda" if torch.cuda.is_available() else "cpu")
    data = prepare_data(dcfg, mcfg.vocab_size, console=console)
    res = loss_eval(model, data, seq_len=dcfg.seq_len, batches=scale.loss_batches,
                    batch_size=_train_batch(Path(ref).parent))
    out.mkdir(parents=True, exist_ok=True)
    write_json({"checkpoint": str(final), "data_of": str(ref), **res}, out / "loss.json")
    console.print(f"{r.name}: loss {res['loss']:.4f} on {res['tokens']:,} validation tokens -> {out / 'loss.json'}")


def _opd_teacher(r: PlannedRun) -> PlannedRun:
    """The teacher of the opd suite's seed of run r (the arm the suite's distill arm names)."""
    label = next(a.teacher for a in r.suite.arms if a.teacher is not None)
    arm = next(a for a in r.suite.arms if a.label == label)
    return PlannedRun(r.suite, arm, r.seed, suite_dir(r) / label / f"seed-{r.seed}")


def _distill_cfg(r: PlannedRun, scale: Scale, resolve: Callable) -> Any:
    """The distill section (loss, sampling) of the opd arm of run r's seed."""
    return resolve("distill", scale.opd_preset, distill_sets(scale, r.seed), None).distill


def _prepare_inputs(r: PlannedRun, scale: Scale, resolve: Callable, generate_batch: Callable | None, console) -> None:
    """Before an opd or sft run: the suite's prompts (from its parent's data) and, for sft, the teacher's samples."""
    if r.arm.teacher is None:
        return
    for need in (parent_dir(r), teacher_dir(r) / "final"):
        if not (need / "config.json").is_file():
            raise AblateError(f"{r.run_dir}: {need} is missing; run the suite from its first arm "
                              f"(k3 ablate {r.suite.name} ...)")
    paths = ablate_opd.ensure_prompts(suite_dir(r), parent_dir(r), scale, console)
    if r.arm.command == "finetune":
        ablate_opd.ensure_teacher_samples(teacher_dir(r) / "final", paths["train"],
                                          ablate_opd.samples_path(teacher_dir(r)), _distill_cfg(r, scale, resolve),
                                          generate_batch, r.seed, console)


def _opd_eval(r: PlannedRun, scale: Scale, resolve: Callable, generate_batch: Callable | None, console) -> None:
    """EVAL_DIR/opd_eval.json: run r's release scored against its seed's teacher on the held-out prompts, and the
    completion tokens per step of its training (opd and sft)."""
    from .evaluate import write_json

    out = Path(r.run_dir) / ablate_opd.EVAL_DIR
    if (out / "opd_eval.json").is_file():
        return
    teacher = _opd_teacher(r)
    final, tfinal = Path(r.run_dir) / "final", Path(teacher.run_dir) / "final"
    if not (tfinal / "config.json").is_file():
        return  # the teacher comes first in the plan; a report-only pass over a partial suite skips this
    paths = ablate_opd.ensure_prompts(suite_dir(r), tfinal, scale, console)
    res = ablate_opd.evaluate(final, tfinal, paths["eval"], _distill_cfg(r, scale, resolve), generate_batch,
                              batch_size=scale.opd_batch, seed=r.seed)
    rc = yaml.safe_load((Path(r.run_dir) / "run_config.yaml").read_text()) or {}
    res["completion_tokens_per_step"] = ablate_opd.completion_tokens_per_step(Path(r.run_dir), rc)
    out.mkdir(parents=True, exist_ok=True)
    write_json(res, out / "opd_eval.json")
    console.print(f"{r.name}: reverse KL to the teacher {res['reverse_kl']:.4f}, NLL of its samples "
                  f"{res['teacher_nll']:.4f} on {res['n_prompts']} held-out prompts -> {out / 'opd_eval.json'}")


def _train_batch(run_dir: Path) -> int:
    rc = yaml.safe_load((run_dir / "run_config.yaml").read_text()) or {}
    return int(((rc.get("config") or {}).get("train") or {}).get("batch_size") or 8)


def run_suites(names: list[str], scale: str, seeds: int, out: str | Path, resume: bool = False, *,
               resolve: Callable, generate_batch: Callable | None = None, env: dict | None = None,
               console=None) -> dict:
    """Run every arm x seed of the named suites into OUT/SUITE/ARM/seed-S/, one at a time, then write the report.

    resolve(command, preset, sets, overrides) -> K3Config: the config resolver (k3.cli passes resolve_config).
    Finished runs with the same config are skipped; interrupted ones are resumed when `resume`, else an error
    says to pass --resume; a failing run stops everything with the run directory and the command that continues.
    Returns {"ran": [...], "skipped": [...], "report": path, "stopped": name or None}.
    """
    from .ablate_report import write_report
    from .console import make_console

    console = console or make_console()
    suites = check_names(list(names), scale)
    sc = SCALES[scale]
    out = Path(out)
    runs = plan(suites, sc, seeds, out, resolve)
    out.mkdir(parents=True, exist_ok=True)
    _write_plan(out, names, scale, seeds, runs, sc)
    again = ablate_command(list(names), scale, seeds, out, resume=True)
    ran, skipped = [], []
    for i, r in enumerate(runs, 1):
        rd = Path(r.run_dir)
        cfg = resolve_run(r, sc, resolve)
        config = plain_config(cfg)
        state = run_state(rd)
        check_saved_config(rd, config)
        head = f"[{i}/{len(runs)}] {r.name}: {r.arm.command}, {cfg.train.max_steps} steps"
        if state == "interrupted" and not resume:
            raise AblateError(f"{rd} holds an interrupted run (a training checkpoint, no final/); continue it with: "
                              f"{again}")
        if state == "finished":
            console.print(f"{head}: finished, skipped")
            skipped.append(r.name)
        else:
            console.print(f"{head}: {'resuming' if state == 'interrupted' else 'starting'} in {rd}")
            preset = {"extend-context": sc.extend_preset, "quantize": sc.quantize_preset,
                      "distill": sc.opd_preset}.get(r.arm.command, sc.preset)
            rc = {"command": r.arm.command, "preset": preset, "config": config, "env": env or {},
                  "init": str(parent_dir(r)) if r.arm.command == "finetune" else None,
                  "ablate": {"suite": r.suite.name, "arm": r.arm.label, "seed": r.seed, "scale": scale,
                             "sets": r.sets, "command": command_line(r, sc)}}
            try:
                _prepare_inputs(r, sc, resolve, generate_batch, console)
                res = _train(r, cfg, sc, state == "interrupted", rc, console, generate_batch)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                raise AblateError(f"run {r.name} failed in {rd}: {type(e).__name__}: {e}\nfix the cause, then "
                                  f"continue with: {again}") from e
            if getattr(res, "final_dir", None) is None:
                console.print(f"stopped in {rd}; continue with: {again}")
                return {"ran": ran, "skipped": skipped, "report": None, "stopped": r.name,
                        "stop_signal": getattr(res, "stop_signal", None)}
            ran.append(r.name)
        if r.arm.label in r.suite.passkey:
            try:
                _passkey(r, sc, generate_batch, console)
            except AblateError:
                raise
            except Exception as e:
                raise AblateError(f"passkey of {r.name} failed in {rd / PASSKEY_DIR}: {type(e).__name__}: {e}\n"
                                  f"continue with: {again}") from e
        if r.arm.label in r.suite.loss_eval:
            try:
                _loss_eval(r, sc, console)
            except Exception as e:
                raise AblateError(f"loss evaluation of {r.name} failed in {rd / LOSS_DIR}: {type(e).__name__}: {e}\n"
                                  f"continue with: {again}") from e
        if r.arm.label in r.suite.opd_eval:
            try:
                _opd_eval(r, sc, resolve, generate_batch, console)
            except AblateError:
                raise
            except Exception as e:
                raise AblateError(f"opd evaluation of {r.name} failed in {rd / ablate_opd.EVAL_DIR}: "
                                  f"{type(e).__name__}: {e}\ncontinue with: {again}") from e
    report = write_report(out)
    console.print(f"[bold green]ablate done[/]: {len(ran)} trained, {len(skipped)} skipped; wrote {report}")
    return {"ran": ran, "skipped": skipped, "report": report, "stopped": None, "stop_signal": None}


def _write_plan(out: Path, names: list[str], scale: str, seeds: int, runs: list[PlannedRun], sc: Scale) -> None:
    """OUT/ablate.json: what was asked and every planned run's command (the report reads it, even for runs that
    never started, so that missing runs are listed)."""
    path = out / "ablate.json"
    prev = json.loads(path.read_text()) if path.is_file() else {}
    suites = dict(prev.get("suites", {}))
    for name in dict.fromkeys(r.suite.name for r in runs):  # this call's plan replaces the suite's earlier one
        suites[name] = {"scale": scale, "seeds": seeds, "scale_params": dataclasses.asdict(sc), "runs": {}}
    for r in runs:
        entry = suites[r.suite.name]
        entry["runs"][r.name] = {"arm": r.arm.label, "seed": r.seed, "dir": str(Path(r.run_dir).relative_to(out)),
                                 "command": command_line(r, sc)}
        entry["command"] = ablate_command([r.suite.name], scale, seeds, out)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"suites": suites}, indent=1))
    os.replace(tmp, path)


def list_lines() -> list[str]:
    """`k3 ablate --list`: one line per suite, its claim (and whether it is wired)."""
    w = max(len(n) for n in SUITES)
    return [f"{n:<{w}}  {s.claim_no:>2}. {s.claim}" + ("" if s.wired else "  [not wired yet]")
            for n, s in SUITES.items()]
