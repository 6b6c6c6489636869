"""The default `k3 pretrain` on the CPU under the host settings of k3cli/host.py against glibc's and OpenMP's plain
behaviour, in one run, as subprocesses of the `k3` command (the settings apply at process start).

    python benchmarks/cpu_host.py [--steps 30] [--pairs 2]

Rows (alternated `--pairs` times so drift on a shared machine hits both): "plain" = OMP_WAIT_POLICY=PASSIVE and
K3_MALLOC=system (what `k3` did before host.py), "k3" = the command's own choice (brief spinning when the cores are
idle, freed memory kept). Prints tok/s of the last logged step, wall seconds, minor page faults and the loss, which
must be identical (the settings do not touch the arithmetic).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"plain": {"OMP_WAIT_POLICY": "PASSIVE", "K3_MALLOC": "system"}, "k3": {}}


def k3_command() -> list[str]:
    exe = Path(sys.executable).with_name("k3")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "k3"]


def one(mode: str, steps: int, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "K3_MALLOC")}
    env.update(MODES[mode])
    out = work / f"run-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*k3_command(), "pretrain", "--out", str(out), "--set", f"train.max_steps={steps}",
           "--set", "train.eval_every=100000", "--set", "ckpt.every=100000", "--set", "train.log_every=10"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    t0 = time.perf_counter()
    res = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"{mode}: k3 pretrain failed (rc {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    logged = re.findall(rf"step {steps}/{steps} loss ([0-9.]+) ([0-9,]+) tok/s", res.stdout)
    if not logged:
        sys.exit(f"{mode}: no step {steps} line in k3 pretrain's output:\n{res.stdout[-2000:]}")
    loss, tok_s = logged[-1]
    return {"mode": mode, "tok_s": float(tok_s.replace(",", "")), "wall": wall, "loss": loss,
            "faults": resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    ap.add_argument("--pairs", type=int, default=2, help="plain / k3 pairs, alternated (default 2)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="k3-cpu-host-") as d:
        work = Path(d)
        for _ in range(args.pairs):
            for mode in MODES:
                rows.append(one(mode, args.steps, work))
                print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    plain = sum(r["tok_s"] for r in rows if r["mode"] == "plain") / args.pairs
    print(f"k3 pretrain (preset tiny), {args.steps} steps, {os.cpu_count()} CPUs, torch threads default")
    print("| settings | tok/s (last logged step) | wall s | minor faults | loss | vs plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['tok_s']:,.0f} | {r['wall']:.1f} | {r['faults']:,} | {r['loss']} | "
              f"{r['tok_s'] / plain:.2f}x |")
    losses = {r["loss"] for r in rows}
    if len(losses) != 1:
        sys.exit(f"the losses differ across settings: {sorted(losses)}")


if __name__ == "__main__":
    main()
