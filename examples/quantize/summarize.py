"""The table of examples/quantize/README.md from the run directories examples/quantize/run.sh writes.

Usage: python examples/quantize/summarize.py CKPT OUT. Every loss is the validation CE (nats per token) over the same
8 batches of 16 x 256 tokens of the standard library's validation split (the batches k3 pretrain evaluates)."""

import json
import sys
from pathlib import Path

import yaml


def evals(run: Path) -> dict:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval" in rec:
            out[rec["eval"]] = rec["val_loss"]
        elif "val_loss" in rec:
            out["final"] = rec["val_loss"]
    return out


def main(ckpt: str, out: str) -> None:
    root = Path(out)
    src = yaml.safe_load((Path(ckpt) / "k3_run.yaml").read_text())["stats"]["final_val_loss"]
    rows = [f"| `{ckpt}` (bf16, before fine-tuning) | {src:.4f} | | |"]
    for mods, label in (("experts", "routed experts"), ("all", "all_linear")):
        ptq, qat = evals(root / f"ptq-{mods}"), evals(root / f"qat-{mods}")["final"]
        bf16, rtn, cal = ptq["source"], ptq["rtn"], ptq["calibrated"]
        gap = rtn - bf16

        def rec(v, gap=gap, rtn=rtn):
            return f"{(rtn - v) / gap:.0%}" if gap > 0 else "n/a"

        rows += [f"| {label}: bf16 fine-tuned (control) | {bf16:.4f} | | |",
                 f"| {label}: RTN PTQ of the control | {rtn:.4f} | {rtn - bf16:+.4f} | 0% |",
                 f"| {label}: calibrated PTQ of the control | {cal:.4f} | {cal - bf16:+.4f} | {rec(cal)} |",
                 f"| {label}: QAT (same data and steps) | {qat:.4f} | {qat - bf16:+.4f} | {rec(qat)} |"]
    print("| model (w4a8, group 32) | val loss | vs bf16 control | PTQ gap recovered |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(*sys.argv[1:3])
