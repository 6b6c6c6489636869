"""`k3 distill`: multi-teacher on-policy distillation through pretrain's loop (train/loop.py Trainer).

Each micro-batch (`DistillBatches.__next__`): draw train.batch_size prompts with their routes (k3.train.
distill_data); the student generates their completions in one batched generation (the `generate` the caller passes:
k3.serve.generate.generate_batch, prefill + recurrent decode; k3.train does not import k3.serve), or, on a fraction
distill.lmbda of the batches, the routed teachers do; each teacher scores the rows routed to it in one forward
without gradients (rows routed to `all` get the renormalized mean of every teacher's log-probabilities); then
`batch_loss` runs the student's forward and the distill.loss on the completion tokens only (k3.train.distill_losses).
Teachers live on the training device (bf16 on a GPU) without gradients or optimizer state.

RUN_DIR is pretrain's layout: run_config.yaml, metrics.jsonl (per teacher NAME: reverse_kl/NAME, student_logprob/
NAME, teacher_logprob/NAME, sample_len/NAME; gen_tokens_per_s; the loop's loss, tokens_per_s, ...), tokenizer/,
checkpoints/step-N/ (the prompt sampler's position is the data state), final/ (the student's release).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from k3.model.checkpoint import CheckpointError, load_model, load_state_into, read_release_config
from k3.model.config import ConfigError
from k3.model.tokenizer import K3Tokenizer
from k3.model.transformer import build_model, count_parameters, describe_parameters

from .console import make_console
from .distill_data import ALL, PromptSampler, read_prompts
from .distill_losses import LOSSES, distill_loss, token_reverse_kl
from .loop import Trainer
from .optim import build_optimizer
from .pretrain import (
    PretrainResult,
    _atomic_write_text,
    _missing_dirs,
    _remove_dirs,
    check_cuda_graph,
    fit_with_progress,
    read_init,
    resolve_autocast,
    resolve_device,
    write_release,
)
from .schedule import lr_at

# generate(model, tok, prompts, max_tokens=, temperature=, top_p=, seeds=, max_num_seqs=) -> new ids per prompt
Generate = Callable[..., list[list[int]]]


def _tokenizer_file(path: Path) -> Path:
    f = path / "tokenizer.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json; pass a release directory written by k3 (RUN_DIR/final)")
    return f


def check_teachers(student: Path, teachers: dict[str, Path]) -> dict[str, Any]:
    """Every teacher shares the student's vocabulary (model vocab_size and tokenizer); ConfigError naming both sizes
    and tokenizer files otherwise. Returns the teachers' ModelConfigs."""
    if not teachers:
        raise ConfigError("give at least one --teacher NAME=CKPT")
    scfg = read_release_config(student)
    sfile = _tokenizer_file(student)
    stok = K3Tokenizer.from_file(sfile)
    cfgs = {}
    for name, path in teachers.items():
        tcfg = read_release_config(path)
        tfile = _tokenizer_file(path)
        ttok = K3Tokenizer.from_file(tfile)
        if tcfg.vocab_size != scfg.vocab_size or ttok.hash() != stok.hash():
            same = "the same size but other tokens" if ttok.vocab_size == stok.vocab_size else "another vocabulary"
            raise ConfigError(f"teacher {name} ({path}) has {same}: model vocab_size {tcfg.vocab_size} and "
                              f"{ttok.vocab_size} tokens in {tfile}, the student vocab_size {scfg.vocab_size} and "
                              f"{stok.vocab_size} tokens in {sfile}; distillation compares the distributions token "
                              f"by token, so make teachers from the student's tokenizer (k3 pretrain --init "
                              f"{student} --preset sft)")
        cfgs[name] = tcfg
    return cfgs


@dataclass
class DistillBatch:
    tokens_BT1: torch.Tensor  # prompt + completion, right-padded
    mask_BT: torch.Tensor  # True where the target is a completion token
    teacher_logp_BTV: torch.Tensor  # the routed teachers' log-probabilities of every next token (fp32, no grad)
    routes_B: list[int]  # teacher index per row, or ALL
    n_targets: int  # targets before the padding (prompt and completion)
    gen_tokens: int  # completion tokens generated
    gen_s: float  # seconds of generation
    teacher_generated: bool


class DistillBatches:
    """The train loader of `k3 distill` (module docstring); state_dict is the prompt sampler's position."""

    def __init__(self, sampler: PromptSampler, student: torch.nn.Module, teachers: list[torch.nn.Module],
                 tok: K3Tokenizer, dcfg, generate: Generate, device: torch.device):
        self.sampler, self.student, self.teachers = sampler, student, teachers
        self.tok, self.dcfg, self.generate, self.device = tok, dcfg, generate, device

    def __iter__(self):
        return self

    def _complete(self, model, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        d = self.dcfg
        return self.generate(model, self.tok, prompts, max_tokens=d.max_new_tokens, temperature=d.temperature,
                             top_p=d.top_p, seeds=seeds, max_num_seqs=d.max_num_seqs)

    def __next__(self) -> DistillBatch:
        prompts, routes, seeds, by_teacher = next(self.sampler)
        ids = [list(p.ids) for p in prompts]
        t0 = time.perf_counter()
        if not by_teacher:
            completions = self._complete(self.student, ids, seeds)
            self.student.train()  # the engine put it in eval mode
        else:  # each teacher completes its own rows; rows routed to all, the teacher their seed picks
            completions = [[] for _ in ids]
            who = [r if r != ALL else s % len(self.teachers) for r, s in zip(routes, seeds)]
            for t, model in enumerate(self.teachers):
                rows = [i for i, w in enumerate(who) if w == t]
                if rows:
                    outs = self._complete(model, [ids[i] for i in rows], [seeds[i] for i in rows])
                    for i, o in zip(rows, outs):
                        completions[i] = o
        gen_s = time.perf_counter() - t0
        L = max(len(p) + len(c) for p, c in zip(ids, completions))
        tokens = torch.full((len(ids), L), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), L - 1, dtype=torch.bool)
        for i, (p, c) in enumerate(zip(ids, completions)):
            tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
            mask[i, len(p) - 1:len(p) + len(c) - 1] = True  # the positions whose targets are completion tokens
        tokens = tokens.to(self.device)
        return DistillBatch(tokens, mask.to(self.device), self._score(tokens[:, :-1], routes), routes,
                            sum(len(p) + len(c) - 1 for p, c in zip(ids, completions)),
                            sum(len(c) for c in completions), gen_s, by_teacher)

    @torch.no_grad()
    def _score(self, inputs_BT: torch.Tensor, routes: list[int]) -> torch.Tensor:
        """Each teacher's log-probabilities on its rows, one forward per teacher; `all` rows: the mean over
        teachers, renormalized."""
        out = None
        r = torch.tensor(routes, device=inputs_BT.device)
        for t, model in enumerate(self.teachers):
            rows = ((r == t) | (r == ALL)).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            logp = F.log_softmax(model(inputs_BT[rows]).logits.float(), -1)
            if out is None:
                out = torch.zeros(*inputs_BT.shape, logp.shape[-1], device=inputs_BT.device)
            is_all = (r[rows] == ALL)[:, None, None]
            out[rows] += torch.where(is_all, logp / len(self.teachers), logp)
        every = r == ALL
        if every.any():
            out[every] = F.log_softmax(out[every], -1)
        return out

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def batch_loss_fn(kind: str, beta: float, names: list[str]) -> Callable:
    """The Trainer's batch_loss: the student's forward, distill.loss on completion tokens, per-teacher metrics."""
    groups = [*names, "all"]

    def batch_loss(model, b: DistillBatch) -> tuple[dict, int, dict]:
        logits = model(b.tokens_BT1[:, :-1]).logits
        V = logits.shape[-1]
        targets = b.tokens_BT1[:, 1:]
        loss = distill_loss(kind, logits.reshape(-1, V), b.teacher_logp_BTV.reshape(-1, V), targets.reshape(-1),
                            b.mask_BT.reshape(-1), beta)
        with torch.no_grad():
            lf = logits.detach().float()
            rkl = token_reverse_kl(lf, b.teacher_logp_BTV)  # [B, T]
            ls = F.log_softmax(lf, -1).gather(-1, targets[..., None])[..., 0]
            lt = b.teacher_logp_BTV.gather(-1, targets[..., None])[..., 0]
            m = b.mask_BT.float()
            stats = {"reverse_kl": float((rkl * m).sum() / m.sum().clamp_min(1)),
                     "gen_tokens_per_s": b.gen_tokens / max(b.gen_s, 1e-9), "teacher_generated": float(
                         b.teacher_generated)}
            r = torch.tensor(b.routes_B, device=m.device)
            for t, name in enumerate(groups):
                rows = r == (ALL if name == "all" else t)
                n = m[rows].sum()
                if n == 0:
                    continue
                stats[f"reverse_kl/{name}"] = float((rkl[rows] * m[rows]).sum() / n)
                stats[f"student_logprob/{name}"] = float((ls[rows] * m[rows]).sum() / n)
                stats[f"teacher_logprob/{name}"] = float((lt[rows] * m[rows]).sum() / n)
                stats[f"sample_len/{name}"] = float(n / rows.sum())
        return {"ce": loss}, b.n_targets, stats

    return batch_loss


def run(cfg: Any, *, student: str | Path, teachers: dict[str, str | Path], prompts: str | Path, run_dir: Path,
        generate: Generate, resume: bool = False, run_config: dict | None = None, console=None,
        command: str = "k3 distill") -> PretrainResult:
    """Distill `teachers` ({NAME: release dir}) into `student` (a release dir) on `prompts` (module docstring).
    `cfg` carries the sections distill, optim, train, ckpt; command: the command line a stopped run's resume hint
    names. Every check runs before anything is written."""
    console = console or make_console()
    dcfg, ocfg, ccfg = cfg.distill, cfg.optim, cfg.ckpt
    tcfg = dataclasses.replace(cfg.train, eval_every=0)  # distillation is measured by the logged reverse KL
    student, run_dir = Path(student), Path(run_dir)
    teachers = {k: Path(v) for k, v in teachers.items()}
    names = list(teachers)
    if dcfg.loss not in LOSSES:
        raise ConfigError(f"distill.loss={dcfg.loss!r}: use one of {', '.join(LOSSES)}")
    if not 0.0 <= dcfg.beta <= 1.0:
        raise ConfigError(f"distill.beta={dcfg.beta} must lie in [0, 1] (0 = forward KL, 1 = reverse KL)")
    if dcfg.max_new_tokens < 1 or dcfg.temperature < 0:
        raise ConfigError(f"distill.max_new_tokens={dcfg.max_new_tokens} must be >= 1 and distill.temperature="
                          f"{dcfg.temperature} >= 0")
    lr_at(0, ocfg, tcfg.max_steps)  # the schedule's checks (warmup within max_steps, ...) before any work
    ckpt_root = run_dir / "checkpoints"
    has_ckpt = ckpt_root.is_dir() and any(p.name.startswith("step-") for p in ckpt_root.iterdir())
    if resume and not has_ckpt:
        raise CheckpointError(f"--resume: no training checkpoint under {ckpt_root}; start without --resume")
    if not resume and (has_ckpt or (run_dir / "final").exists()):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or choose another --out")
    check_teachers(student, teachers)
    init = read_init(student)
    if init.quantization is not None:
        raise CheckpointError(f"{student}: a quantized release ({init.quantization}) cannot be trained; distill into "
                              f"the bf16 / fp32 release it was made from")
    tok = K3Tokenizer.from_file(_tokenizer_file(student))
    plist = read_prompts(prompts, tok, names, context=init.trained_seq_len, max_new_tokens=dcfg.max_new_tokens)
    sampler = PromptSampler(plist, names, routing=dcfg.routing, default_teacher=dcfg.default_teacher,
                            batch_size=tcfg.batch_size, seed=tcfg.seed, lmbda=dcfg.lmbda)
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = resolve_device(tcfg.device)
    autocast = resolve_autocast(tcfg.dtype, device)
    check_cuda_graph(tcfg, device, data_parallel=False, custom_loss=True)
    torch.manual_seed(tcfg.seed)

    mcfg = init.cfg
    model = build_model(mcfg, seed=tcfg.seed, device="cpu")
    load_state_into(model, init.state)
    model.to(device)
    tdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tmodels = []
    for name in names:
        m, _ = load_model(teachers[name], device=device, dtype=tdtype)
        tmodels.append(m.eval().requires_grad_(False))
    counts = count_parameters(model)
    optimizer = build_optimizer(model, ocfg)
    loader = DistillBatches(sampler, model, tmodels, tok, dcfg, generate, device)

    made = _missing_dirs(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        tok.save(run_dir / "tokenizer")
        rc = {**(run_config or {}), "student": str(student), "teachers": {k: str(v) for k, v in teachers.items()},
              "prompts": str(prompts),
              "stats": {"n_params_total": counts["total"], "n_params_active": counts["active"],
                        "n_prompts": len(plist), "prompts_per_teacher": {
                            n: sum(p.teacher == n for p in plist) for n in names}}}
        _atomic_write_text(run_dir / "run_config.yaml", yaml.safe_dump(rc, sort_keys=False))
    except BaseException:
        _remove_dirs(made)
        raise
    if not resume:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    trainer = Trainer(model, optimizer, ocfg, tcfg, ccfg, run_dir, loader, list, bytes_per_token=None,
                      device=device, autocast_dtype=autocast, batch_loss=batch_loss_fn(dcfg.loss, dcfg.beta, names))
    header = (f"[bold]k3 distill[/] {mcfg.name}: {describe_parameters(counts)}, teachers {', '.join(names)}, "
              f"{len(plist)} prompts, loss {dcfg.loss}, device {device}, run dir {run_dir}")
    state = fit_with_progress(trainer, tcfg, console, resume=resume, header=header, command=command)
    if trainer.stopped_by_signal:
        return PretrainResult(run_dir, None, state.step, None, None, state.wall_time, state.tokens,
                              stop_signal=trainer.stop_signal)
    rc["stats"].update(tokens=state.tokens, steps=state.step, wall_time_s=state.wall_time)
    _atomic_write_text(run_dir / "run_config.yaml", yaml.safe_dump(rc, sort_keys=False))
    final = write_release(run_dir, {k: v.detach().cpu() for k, v in model.state_dict().items()}, mcfg, tok, rc,
                          ccfg.export_dtype, init.trained_seq_len)
    trainer.save_checkpoint()
    console.print(f"[bold green]done[/] step {state.step}: {state.tokens / 1e6:.2f}M tokens in "
                  f"{state.wall_time:.0f}s; checkpoint: {final}")
    return PretrainResult(run_dir, Path(final), state.step, None, None, state.wall_time, state.tokens)
