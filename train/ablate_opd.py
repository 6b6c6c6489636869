"""The opd suite of `k3 ablate` (claim 9): on-policy distillation (`k3 distill`) vs SFT on the teacher's samples,
from one student parent at equal student steps (docs/ablate.md).

What this module adds to the runner (k3.train.ablate):
- the prompts: SUITE_DIR/prompts/{train,eval}.jsonl, token windows of the parent's data (train / val split) without a
  document boundary, drawn with data.seed and decoded to text (`ensure_prompts`);
- the SFT data: the teacher's completions of the train prompts, sampled once through the batched generation k3 distill
  uses (the `generate` passed in) with the distill config's sampling settings, written as prompt/completion JSONL
  for `k3 pretrain --init` (`ensure_teacher_samples`);
- the sft arm's budget: k3 distill's optimizer, steps and batch, its sequence length prompt + completion tokens
  (`sft_sets`);
- the evaluation on the held-out prompts (`evaluate`): DistillBatches generates and the teacher scores, and
  batch_loss_fn's statistics give the reverse KL on the student's own samples and the student's log-probability of
  the teacher's samples; every arm of a seed sees the same prompts and sampling seeds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .ablate_suites import AblateError, Scale

PROMPTS_DIR = "prompts"
SAMPLES_DIR = "samples"
EVAL_DIR = "opd_eval"
TEACHER = "teacher"  # the --teacher NAME of the opd arm
_SPLITS = {"train": 0, "eval": 1}  # the rng stream of each prompt file
SAMPLE_SALT, EVAL_SALT = 2, 3  # rng streams of the SFT samples' and the evaluation's sampling seeds


def prompts_path(suite_dir: Path, split: str) -> Path:
    return Path(suite_dir) / PROMPTS_DIR / f"{split}.jsonl"


def samples_path(teacher_run_dir: Path) -> Path:
    """The SFT data: the teacher's completions of the train prompts, beside the teacher's run."""
    return Path(teacher_run_dir) / SAMPLES_DIR / "samples.jsonl"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _check_meta(meta_path: Path, want: dict, files: list[Path]) -> bool:
    """True when meta_path records `want` and the files exist (reuse them); False when nothing is there yet;
    AblateError when another setting made them (a changed scale under the same --out)."""
    if not meta_path.is_file():
        return False
    have = json.loads(meta_path.read_text())
    if {k: have.get(k) for k in want} != want or not all(f.is_file() for f in files):
        diff = sorted(k for k in want if have.get(k) != want[k]) or ["files"]
        raise AblateError(f"{meta_path.parent} holds files made with other settings ({', '.join(diff)}); use another "
                          f"--out, or delete {meta_path.parent} to make them again")
    return True


# ---------------------------------------------------------------------------------------------------- prompts


def draw_prompts(data, split: str, n: int, prompt_tokens: int, seed: int) -> list[str]:
    """n texts of prompt_tokens - 1 tokens (BOS makes prompt_tokens) from data's train or val shard: windows at
    random starts (rng (seed, split)) that hold no special token (a document boundary), decode to valid text and
    encode back without special tokens. Deterministic for a given shard and seed."""
    tok = data.tokenizer
    shard = data.train if split == "train" else data.val
    L = prompt_tokens - 1
    if L < 1 or shard.n_tokens < L + 1:
        raise AblateError(f"opd prompts of {prompt_tokens} tokens: the {shard.name} split of {data.cache_dir} has "
                          f"{shard.n_tokens} tokens; lower opd_prompt_tokens or add data")
    special = {tok.bos_id, tok.eos_id, tok.pad_id}
    rng = np.random.default_rng([seed, _SPLITS[split]])
    out: list[str] = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        s = int(rng.integers(0, shard.n_tokens - L))
        ids = [int(x) for x in shard.tokens[s:s + L]]
        if special.intersection(ids):
            continue
        text = tok.decode(ids)
        # a window cut inside a multi-byte character, or text that reads as a special token, is left out
        if not text.strip() or "\ufffd" in text or tok.encode(text) != tok.encode(text, parse_special=False):
            continue
        out.append(text)
    if len(out) < n:
        raise AblateError(f"drew only {len(out)} of {n} {split} prompts of {prompt_tokens} tokens without a document "
                          f"boundary from {data.cache_dir}; lower opd_prompt_tokens or add data")
    return out


def ensure_prompts(suite_dir: Path, final: Path, scale: Scale, console=None) -> dict[str, Path]:
    """SUITE_DIR/prompts/{train,eval}.jsonl from the data `final` was trained on (made once; the same for every seed:
    the data and data.seed are shared); train holds opd_steps x opd_batch prompts, eval opd_eval_prompts."""
    from k3.model.checkpoint import read_release_config

    from .data import prepare_data
    from .evaluate import run_data_config

    dcfg = run_data_config(final)
    data = prepare_data(dcfg, read_release_config(final).vocab_size, console=console, show_progress=False)
    counts = {"train": scale.opd_steps * scale.opd_batch, "eval": scale.opd_eval_prompts}
    paths = {s: prompts_path(suite_dir, s) for s in counts}
    want = {"counts": counts, "prompt_tokens": scale.opd_prompt_tokens, "seed": dcfg.seed,
            "data": data.cache_dir.name, "tokenizer": data.tokenizer.hash()}
    meta = Path(suite_dir) / PROMPTS_DIR / "prompts.json"
    if _check_meta(meta, want, list(paths.values())):
        return paths
    for split, n in counts.items():
        texts = draw_prompts(data, split, n, scale.opd_prompt_tokens, dcfg.seed)
        _write_atomic(paths[split], "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    _write_atomic(meta, json.dumps({**want, "source": dcfg.source, "split_of": {"train": "train", "eval": "val"}},
                                   indent=1))
    if console is not None:
        console.print(f"opd prompts: {counts['train']} train + {counts['eval']} eval prompts of "
                      f"{scale.opd_prompt_tokens} tokens -> {meta.parent}")
    return paths


# ---------------------------------------------------------------------------------------------------- SFT data


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_teacher_samples(teacher_final: Path, prompts: Path, out: Path, dcfg: Any, generate: Callable | None,
                           seed: int, console=None) -> dict:
    """out (prompt/completion JSONL): the teacher's completion of every prompt of `prompts`, in one call of
    `generate` (k3 distill's batched generation) with dcfg's max_new_tokens, temperature, top_p and max_num_seqs,
    prompt i sampled with seed i of rng (seed, salt). A trailing EOS is dropped (the SFT data's separator takes its
    place); empty completions are left out (the data reader refuses them) and counted. Returns the meta record."""
    from k3.model.checkpoint import load_model, trained_seq_len
    from k3.model.tokenizer import K3Tokenizer

    from .distill_data import read_prompts

    if generate is None:
        raise AblateError("the opd suite's sft arm needs generate_batch (k3.serve.generate.generate_batch) to sample "
                          "the teacher")
    sampling = {k: getattr(dcfg, k) for k in ("max_new_tokens", "temperature", "top_p", "max_num_seqs")}
    want = {"teacher": str(teacher_final), "prompts": str(prompts), "seed": seed, **sampling}
    meta_path = out.parent / "samples.json"
    if _check_meta(meta_path, want, [out]):
        return json.loads(meta_path.read_text())
    tok = K3Tokenizer.from_file(Path(teacher_final) / "tokenizer.json")
    texts = [json.loads(x)["prompt"] for x in prompts.read_text(encoding="utf-8").splitlines() if x.strip()]
    plist = read_prompts(prompts, tok, [TEACHER], context=trained_seq_len(teacher_final),
                         max_new_tokens=dcfg.max_new_tokens)
    model, _ = load_model(teacher_final, device=_device())
    model.eval().requires_grad_(False)
    seeds = [int(s) for s in np.random.default_rng([seed, SAMPLE_SALT]).integers(2**31 - 1, size=len(plist))]
    outs = generate(model, tok, [list(p.ids) for p in plist], max_tokens=dcfg.max_new_tokens,
                    temperature=dcfg.temperature, top_p=dcfg.top_p, seeds=seeds, max_num_seqs=dcfg.max_num_seqs)
    lines, lens, empty = [], [], 0
    for text, ids in zip(texts, outs):
        ids = ids[:-1] if ids and ids[-1] == tok.eos_id else ids
        completion = tok.decode(ids)
        if not completion.strip():
            empty += 1
            continue
        lines.append(json.dumps({"prompt": text, "completion": completion}) + "\n")
        lens.append(len(ids))
    if not lines:
        raise AblateError(f"the teacher {teacher_final} completed none of the {len(texts)} prompts of {prompts} with "
                          f"text; the SFT arm has no data")
    _write_atomic(out, "".join(lines))
    rec = {**want, "n_samples": len(lines), "n_empty": empty, "mean_completion_tokens": float(np.mean(lens)),
           "mean_prompt_tokens": float(np.mean([len(p.ids) for p in plist]))}
    _write_atomic(meta_path, json.dumps(rec, indent=1))
    if console is not None:
        console.print(f"opd: {len(lines)} teacher samples ({rec['mean_completion_tokens']:.1f} completion tokens on "
                      f"average, {empty} empty left out) -> {out}")
    return rec


def _fmt(v: Any) -> str:
    """A --set value that parses back to v (a float keeps its dot, which YAML needs to read it as a float)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        s = repr(v)
        return s if "." in s or "e" not in s else f"{v:.6e}"
    return str(v)


def sft_sets(dist: Any, sft: Any, scale: Scale, samples: Path) -> list[str]:
    """The --set entries that give the sft arm (pretrain config `sft`, resolved without them) k3 distill's student
    budget (config `dist`): its batch and accumulation, its sequence length prompt + completion tokens, the teacher's
    samples as data, and every optimizer field where the two differ (lr, warmup, MTP weights of the distill preset)."""
    sets = [f"data.source={samples}", f"data.seq_len={scale.opd_prompt_tokens + dist.distill.max_new_tokens}",
            f"data.val_fraction={_fmt(scale.opd_sft_val_fraction)}",
            f"train.batch_size={dist.train.batch_size}", f"train.grad_accum={dist.train.grad_accum}"]
    for f in dataclasses.fields(dist.optim):
        a, b = getattr(dist.optim, f.name), getattr(sft.optim, f.name)
        if a != b:
            if isinstance(a, (list, dict)):
                raise AblateError(f"optim.{f.name} of the distill preset {scale.opd_preset!r} differs from the "
                                  f"pretrain preset's; the sft arm cannot copy a list through --set")
            sets.append(f"optim.{f.name}={_fmt(a)}")
    return sets


# ---------------------------------------------------------------------------------------------------- evaluation


class _InOrder:
    """The prompt sampler DistillBatches reads during evaluation: every prompt once, in file order, batch_size at a
    time, with fixed sampling seeds (so every arm of a seed sees the same prompts and, teacher-generated, the same
    samples); generated by the teacher when `by_teacher`."""

    def __init__(self, prompts: list, batch_size: int, seeds: list[int], by_teacher: bool):
        self.prompts, self.batch_size, self.seeds, self.by_teacher, self.pos = prompts, batch_size, seeds, by_teacher, 0

    def __next__(self):
        if self.pos >= len(self.prompts):
            raise StopIteration
        lo, hi = self.pos, min(self.pos + self.batch_size, len(self.prompts))
        self.pos = hi
        return self.prompts[lo:hi], [0] * (hi - lo), self.seeds[lo:hi], self.by_teacher


def evaluate(student_final: Path, teacher_final: Path, prompts: Path, dcfg: Any, generate: Callable | None, *,
             batch_size: int, seed: int) -> dict:
    """Scores of the release `student_final` against `teacher_final` on the held-out prompts (k3 distill's own
    generation, teacher scoring and per-token statistics, batch_loss_fn; mean over completion tokens):
        reverse_kl        KL(student || teacher) on the student's samples (what k3 distill minimizes)
        teacher_nll       -log p_student of the teacher's samples (the student's loss under the teacher's
                          distribution: cross-entropy H(teacher) + KL(teacher || student) per token)
        teacher_self_nll  -log p_teacher of the same samples (the floor of teacher_nll)"""
    from k3.model.checkpoint import load_model
    from k3.model.tokenizer import K3Tokenizer

    from .distill import DistillBatches, batch_loss_fn, check_teachers
    from .distill_data import read_prompts

    if generate is None:
        raise AblateError("the opd evaluation needs generate_batch (k3.serve.generate.generate_batch)")
    check_teachers(Path(student_final), {TEACHER: Path(teacher_final)})
    tok = K3Tokenizer.from_file(Path(student_final) / "tokenizer.json")
    plist = read_prompts(prompts, tok, [TEACHER], context=None, max_new_tokens=dcfg.max_new_tokens)
    device = torch.device(_device())
    student, _ = load_model(student_final, device=device)
    teacher, _ = load_model(teacher_final, device=device)
    for m in (student, teacher):
        m.eval().requires_grad_(False)
    seeds = [int(s) for s in np.random.default_rng([seed, EVAL_SALT]).integers(2**31 - 1, size=len(plist))]
    loss = batch_loss_fn(dcfg.loss, dcfg.beta, [TEACHER])
    sums: dict[str, dict[str, float]] = {}
    for who, by_teacher in (("student", False), ("teacher", True)):
        acc = sums.setdefault(who, {"tokens": 0.0, "reverse_kl": 0.0, "student_lp": 0.0, "teacher_lp": 0.0})
        for b in DistillBatches(_InOrder(plist, batch_size, seeds, by_teacher), student, [teacher], tok, dcfg,
                                generate, device):
            student.eval()  # DistillBatches returns the student to training mode after it samples
            with torch.no_grad():
                _, _, st = loss(student, b)
            n = float(b.mask_BT.sum())
            acc["tokens"] += n
            acc["reverse_kl"] += st["reverse_kl"] * n
            acc["student_lp"] += st.get(f"student_logprob/{TEACHER}", 0.0) * n
            acc["teacher_lp"] += st.get(f"teacher_logprob/{TEACHER}", 0.0) * n
    s, t = sums["student"], sums["teacher"]
    return {"reverse_kl": s["reverse_kl"] / max(s["tokens"], 1), "teacher_nll": -t["student_lp"] / max(t["tokens"], 1),
            "teacher_self_nll": -t["teacher_lp"] / max(t["tokens"], 1),
            "reverse_kl_on_teacher_samples": t["reverse_kl"] / max(t["tokens"], 1),
            "n_prompts": len(plist), "student_completion_tokens": int(s["tokens"]),
            "teacher_completion_tokens": int(t["tokens"]), "prompts": str(prompts), "teacher": str(teacher_final),
            "student": str(student_final), "seed": seed}


def completion_tokens_per_step(run_dir: Path, rc: dict) -> float | None:
    """Completion (loss) tokens of one optimizer step of an opd or sft run: k3 distill's logged completion length
    per prompt x prompts per step (mean over the logged steps); for the sft arm, the loss-mask fraction of its
    training shard x the tokens of a step (the windows are drawn uniformly); None for a pretrain arm."""
    cfg = rc.get("config") or {}
    train = cfg.get("train") or {}
    per_step = int(train.get("batch_size", 0)) * int(train.get("grad_accum", 1))
    if "teachers" in rc:
        lens = []
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if f"sample_len/{TEACHER}" in rec:
                lens.append(rec[f"sample_len/{TEACHER}"])
        return float(np.mean(lens)) * per_step if lens else None
    if rc.get("init") is None or not (cfg.get("data") or {}).get("source", "").endswith(".jsonl"):
        return None
    from k3.model.checkpoint import read_release_config

    from .config import DataConfig
    from .data import prepare_data

    d = cfg["data"]
    dcfg = DataConfig(**{**d, "tokenizer": str(Path(run_dir) / "tokenizer" / "tokenizer.json")})
    data = prepare_data(dcfg, read_release_config(Path(run_dir) / "final").vocab_size, show_progress=False)
    mask = data.train.loss_mask
    frac = 1.0 if mask is None else float(np.asarray(mask[1:], dtype=np.float64).mean())
    return frac * per_step * int(d["seq_len"])
