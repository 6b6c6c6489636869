"""Which inference forwards in K halves are right on a GPU: chunk_kda with the q / k L2 norm and no gradients, per
input dtype, key and value dims, length and form (whole, K halves; q's rows by rstd or q normalised by the pass),
against the float64 recurrence on the normalised q, k. One table row per case, each case in a process of its own,
so that an illegal address in one cannot fail the others.

Run on a CUDA machine (never in tests): `python benchmarks/repro/kda_split_check.py [--dtypes bfloat16 float16
float32] [--quick] [--set NAME.KEY=VALUE ...]`; `--backend torch --device cpu` runs the same cases through the PyTorch
path (a check of the script itself; the K split and q's rstd then change nothing). fp32 rows run whole only (the
split needs fp16 L, which chunk_kda takes for bf16 / fp16 inputs).

Why: Triton 3.6 miscompiles the w/u kernel's u dot at V blocks below 64 on the H200, whole as well as in K halves,
in bf16 and fp16 (at V = 32: rel_rms 0.6-0.8 or an illegal address), which launch.v_block's floor
LAUNCH["wu"]["MIN_BV"] avoids; `--set wu.MIN_BV=32` restores the faulty launch, `--set wu.BV=16 --set wu.MIN_BV=16`
the V-block-16 one at V = 128 (compute-sanitizer: an out-of-bounds shared-memory read in the u dot). Run this on a
new Triton or GPU before lowering the floor, or after changing the K split (LAUNCH["intra"]["KSPLIT_FROM"]).
Threshold 0.02, the bf16 one of the tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

THRESHOLD = 0.02  # bf16 inference output vs float64 (tests/kernels/test_kda_triton.py)


def run_case(case: dict) -> dict:
    """The case's rel_rms of o and of the final state; in this process (the child)."""
    os.environ["K3_KERNELS"] = case["backend"]
    import torch

    from k3.kernels.kda import chunk_kda, naive_recurrent_kda
    from k3.kernels.kda.triton.launch import LAUNCH, set_launch_entry

    LAUNCH["intra"]["KSPLIT_FROM"] = case["split"]
    LAUNCH["intra"]["Q_RSTD"] = case["q_rstd"]
    for item in case["set"]:  # --set NAME.KEY=VALUE, as kda_tune.py's
        set_launch_entry(item)
    dt = getattr(torch, case["dtype"])
    B, T, H, K, V = 1, case["T"], 2, case["K"], case["V"]
    torch.manual_seed(0)
    q, k = 3 * torch.randn(B, T, H, K), 0.5 * torch.randn(B, T, H, K)
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K)).clamp_min(-5.0)
    h0 = torch.randn(B, H, K, V)
    xs = [x.to(dt) for x in (q, k, v)]
    ref = naive_recurrent_kda(*(x.double() / x.double().norm(dim=-1, keepdim=True) for x in xs[:2]),
                              xs[2].double(), g.double(), beta.to(dt).double(), initial_state=h0.double(),
                              output_final_state=True)
    dev = case["device"]
    with torch.no_grad():
        o, s = chunk_kda(*(x.to(dev) for x in xs), g.to(dev), beta.to(dt).to(dev), initial_state=h0.to(dev),
                         output_final_state=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    if dev == "cuda":
        torch.cuda.synchronize()

    def rel(r, x):
        return ((x.double().cpu() - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()

    return {"o": rel(ref[0], o), "ht": rel(ref[1], s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="K = 64 and 128 at T = 70 only")
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="a launch setting for every case (launch.set_launch_entry), e.g. wu.MIN_BV=32")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case (JSON) and print its result
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))), flush=True)
        return
    lengths = (70,) if args.quick else (64, 70, 200)
    print("| dtype | K | V | T | K split | q rows by rstd | rel_rms o | rel_rms ht | verdict |")
    print("|---|---:|---:|---:|---|---|---:|---:|---|")
    for dtype, K, T in itertools.product(args.dtypes, (64, 128), lengths):
        for V, split, q_rstd in itertools.product((32, K), (0, K), (True, False)):
            if dtype == "float32" and split:
                continue
            case = {"dtype": dtype, "K": K, "V": V, "T": T, "split": split, "q_rstd": q_rstd,
                    "backend": args.backend, "device": args.device, "set": args.set}
            # check=False: a case that crashes is a row of the table, not the end of the run
            proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], check=False,
                                  capture_output=True, text=True, timeout=300)
            lines = proc.stdout.strip().splitlines()
            try:
                res = json.loads(lines[-1])
                verdict = "ok" if max(res.values()) < THRESHOLD else "**WRONG**"
                o, ht = f"{res['o']:.2e}", f"{res['ht']:.2e}"
            except (IndexError, json.JSONDecodeError):
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:80]
                o = ht = "-"
                verdict = f"**failed** (rc {proc.returncode}: {err})"
            print(f"| {dtype} | {K} | {V} | {T} | {'halves' if split else 'whole'} | {q_rstd} | {o} | {ht} | "
                  f"{verdict} |", flush=True)


if __name__ == "__main__":
    main()
