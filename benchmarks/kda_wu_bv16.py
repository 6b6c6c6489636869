"""The w/u kernel's V-block-16 crash on the H200, reproduced for compute-sanitizer (triton_chunk.v_block keeps that
kernel at V blocks >= 32; this script lifts the guard).

Run on a CUDA machine (never in tests):
    compute-sanitizer --tool memcheck --print-limit 3 python3 benchmarks/kda_wu_bv16.py [--bv 16] [--B 1] [--T 2048]
        [--all-kernels] [--warps 4 --stages 1]
One chunk_kda fwd+bwd at (B, T, 16, 128), bf16, with the chosen V block for the w/u kernel (`--all-kernels`: for
every chunk kernel with a V block; `--warps`: every kernel at that num_warps, as in a kda_tune.py sweep). Session 9:
kda_tune.py's configuration "every kernel at V block 32, 4 warps, 1 stage" hit an illegal memory access at
(8, 4096, 16, 128); not yet localized. Session 8 (2026-11-30, Triton 3.6): an invalid __shared__ read of 512 bytes in the u
dot of `_wu_kernel` (M [64, 64] @ (beta v) [64, 16]): an address in shared memory that Triton lays out, not in ours.
"""

from __future__ import annotations

import argparse
import os

os.environ["K3_KERNELS"] = "triton"
os.environ["K3_KDA_BWD"] = "triton"

import torch

from k3.kernels.kda import chunk_kda
from k3.kernels.kda import triton_chunk as fwd_mod
from k3.kernels.kda import triton_chunk_bwd as bwd_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bv", type=int, default=16)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--all-kernels", action="store_true", help="every kernel with a V block at --bv, not only w/u")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--warps", type=int, default=None, help="every chunk kernel at this num_warps (and --stages), as "
                    "a kda_tune.py configuration does; default: each kernel's LAUNCH entry")
    ap.add_argument("--stages", type=int, default=1)
    args = ap.parse_args()
    if args.warps:
        for mod in (fwd_mod, bwd_mod):
            for d in mod.LAUNCH.values():
                d.update(num_warps=args.warps, num_stages=args.stages)
    names = [(m, n) for m in (fwd_mod, bwd_mod) for n, d in m.LAUNCH.items() if "BV" in d]
    for mod, name in names if args.all_kernels else [(fwd_mod, "wu")]:
        mod.LAUNCH[name]["BV"] = args.bv
    guarded = fwd_mod.v_block
    fwd_mod.v_block = lambda name, V, BK: min(args.bv, V) if name == "wu" else guarded(name, V, BK)
    torch.manual_seed(0)
    B, H, D = args.B, 16, 128
    q, k, v = (torch.randn(B, args.T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = (-5.0 * torch.sigmoid(torch.randn(B, args.T, H, D, device="cuda"))).requires_grad_()
    beta = torch.rand(B, args.T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    o = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)[0]
    torch.cuda.synchronize()
    print("forward ok", flush=True)
    o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("backward ok", flush=True)


if __name__ == "__main__":
    main()
