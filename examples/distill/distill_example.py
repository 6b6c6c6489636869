"""Helpers of examples/distill/run.sh: the two domains' data, the teachers' samples, and the evaluation.

    data OUT BASE       OUT/{a,b}_{train,val}.jsonl (prompt/completion windows of two groups of standard-library
                        packages, prompts of <= 128 tokens of BASE's tokenizer) and OUT/prompts.jsonl (the train prompts, each naming its domain's teacher)
    samples OUT N K     OUT/teacher_samples.jsonl: each teacher's own completions of its first K train prompts (the
                        off-policy SFT baseline's data), N tokens at most each, at the distill temperature 1
    evaluate OUT        OUT/summary.json and OUT/summary.md: per-domain validation loss (completion tokens) of the
                        base, each teacher, the on-policy student and the SFT student at each saved step, the
                        reverse KL over the distillation's steps, and the two goals of the issue
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import torch

from k3.model.checkpoint import load_model, load_state_into, read_release_config
from k3.model.tokenizer import K3Tokenizer
from k3.model.transformer import build_model
from k3.train.checkpoint import load_checkpoint
from k3.train.loop import lm_losses
from k3.train.pretrain import read_init

DOMAINS = {"a": ("email", "http", "urllib", "xml", "json", "html"),  # formats and networking
           "b": ("tkinter", "idlelib", "turtledemo")}  # GUI code
PROMPT_LINES, COMPLETION_LINES, MAX_CHARS = 6, 4, 300


def _windows(path: Path):
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    step = PROMPT_LINES + COMPLETION_LINES
    for i in range(0, len(lines) - step, step):
        prompt = "".join(lines[i:i + PROMPT_LINES])[-MAX_CHARS:]
        completion = "".join(lines[i + PROMPT_LINES:i + step])[:MAX_CHARS]
        if prompt.strip() and completion.strip():
            yield prompt, completion


def make_data(out: Path, base: Path, per_domain: int = 1200, max_prompt_tokens: int = 128) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = K3Tokenizer.from_file(base)
    lib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name, packages in DOMAINS.items():
        files = sorted(f for p in packages for f in (lib / p).rglob("*.py") if "test" not in f.parts)
        if not files:  # some Python builds leave the GUI packages out (a separate python3-tk / idle package)
            sys.exit(f"domain {name}: none of the standard-library packages {', '.join(packages)} is under {lib}; "
                     "run the example with a Python that ships them (e.g. install python3-tk and idle)")
        recs = {"train": [], "val": []}
        for f in files:  # split by file: validation windows come from files the teachers never saw
            split = "val" if int(hashlib.sha256(str(f.relative_to(lib)).encode()).hexdigest(), 16) % 10 == 0 else \
                "train"
            recs[split] += [{"prompt": p, "completion": c} for p, c in _windows(f)
                            if len(tok.encode(p, add_bos=True)) <= max_prompt_tokens]
        recs["train"] = recs["train"][:per_domain]
        recs["val"] = recs["val"][:per_domain // 12]
        for split, rows in recs.items():
            (out / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        prompts += [{"prompt": r["prompt"], "teacher": name} for r in recs["train"]]
        print(f"domain {name}: {len(recs['train'])} train / {len(recs['val'])} val windows from {len(files)} files")
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


def make_samples(out: Path, max_tokens: int, per_teacher: int) -> None:
    from k3.serve.generate import generate_batch

    rows = []
    for name in DOMAINS:
        model, _ = load_model(out / f"teacher_{name}" / "final")
        tok = K3Tokenizer.from_file(out / f"teacher_{name}" / "final")
        lines = (out / f"{name}_train.jsonl").read_text().splitlines()[:per_teacher]
        prompts = [json.loads(x)["prompt"] for x in lines]
        ids = [tok.encode(p, add_bos=True) for p in prompts]
        outs = generate_batch(model, tok, ids, max_tokens=max_tokens, temperature=1.0, seeds=list(range(len(ids))),
                              max_num_seqs=64)
        for p, o in zip(prompts, outs):
            text = tok.decode([t for t in o if t != tok.eos_id])
            if text.strip():
                rows.append({"prompt": p, "completion": text})
        print(f"teacher {name}: {len(outs)} samples")
    (out / "teacher_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@torch.no_grad()
def _val_loss(model, tok: K3Tokenizer, path: Path, batch: int = 32) -> float:
    """Mean CE of the completion tokens given the prompt (the documents as k3 pretrain packs them: EOT, prompt,
    completion, with the prompt encoded as plain text)."""
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    total, count = 0.0, 0
    for i in range(0, len(recs), batch):
        rows = []
        for r in recs[i:i + batch]:
            p = tok.encode(r["prompt"], parse_special=False)
            c = tok.encode(r["completion"], parse_special=False)
            rows.append(([tok.eos_id, *p, *c], len(p) + 1))
        L = max(len(ids) for ids, _ in rows)
        tokens = torch.full((len(rows), L), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), L - 1, dtype=torch.bool)
        for j, (ids, start) in enumerate(rows):
            tokens[j, :len(ids)] = torch.tensor(ids)
            mask[j, start - 1:len(ids) - 1] = True
        n = int(mask.sum())
        total += lm_losses(model, tokens, mask, with_mtp=False)["ce"].item() * n
        count += n
    return total / count


def _model(path: Path, base: Path):
    """A release, or a training checkpoint of a student of `base`'s architecture."""
    if (path / "train_state.json").is_file():
        cfg, state = read_release_config(base), load_checkpoint(path)["model_state"]
    else:
        cfg, state = read_release_config(path), read_init(path).state
    m = build_model(cfg, device="cpu")
    load_state_into(m, state)
    return m.eval()


def evaluate(out: Path, base: Path) -> dict:
    tok = K3Tokenizer.from_file(base)
    vals = {d: out / f"{d}_val.jsonl" for d in DOMAINS}

    def losses(path: Path) -> dict:
        m = _model(path, base)
        return {d: round(_val_loss(m, tok, v), 4) for d, v in vals.items()}

    res = {"base": losses(base), **{f"teacher_{d}": losses(out / f"teacher_{d}" / "final") for d in DOMAINS}}
    curves = {}
    for run in ("distill", "sft"):
        ck = sorted((out / run / "checkpoints").glob("step-*"))
        curves[run] = {int(p.name.split("-")[1]): losses(p) for p in ck}
        res[run] = losses(out / run / "final")
    rkl = [(r["step"], r["reverse_kl"]) for r in map(json.loads, (out / "distill" / "metrics.jsonl").open())
           if "reverse_kl" in r]
    gap = {d: (res["base"][d] - res["distill"][d]) / max(res["base"][d] - res[f"teacher_{d}"][d], 1e-9)
           for d in DOMAINS}
    sft_steps = max(curves["sft"]) if curves["sft"] else None
    reach = next((s for s, v in sorted(curves["distill"].items())
                  if all(v[d] <= res["sft"][d] for d in DOMAINS)), None)
    summary = {"val_loss": res, "curves": {k: {str(s): v for s, v in c.items()} for k, c in curves.items()},
               "reverse_kl": rkl, "gap_closed": {d: round(g, 3) for d, g in gap.items()},
               "distill_step_reaching_sft_final": reach, "sft_steps": sft_steps}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["| model | " + " | ".join(f"val loss {d}" for d in DOMAINS) + " |", "|---|" + "---|" * len(DOMAINS)]
    lines += [f"| {k} | " + " | ".join(f"{v[d]:.4f}" for d in DOMAINS) + " |" for k, v in res.items()]
    lines += ["", "gap closed by the on-policy student (base -> teacher): "
              + ", ".join(f"{d} {g:.1%}" for d, g in gap.items()),
              (f"first distill checkpoint at or below the SFT student's final loss on both domains: step {reach} "
              f"(SFT ran {sft_steps} steps)"),
              "reverse KL over distill steps: " + ", ".join(f"{s}: {v:.3f}" for s, v in rkl)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    cmd, out = sys.argv[1], Path(sys.argv[2])
    if cmd == "data":
        make_data(out, Path(sys.argv[3]))
    elif cmd == "samples":
        make_samples(out, int(sys.argv[3]), int(sys.argv[4]))
    elif cmd == "evaluate":
        evaluate(out, Path(sys.argv[3]))
    else:
        sys.exit(f"unknown step {cmd!r}: data | samples | evaluate")
