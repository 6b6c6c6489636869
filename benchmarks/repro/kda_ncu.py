"""k3's and fla-core's chunk_kda fwd+bwd, one step each, for Nsight Compute: run it under
`ncu --profile-from-start off ...` (the warm-up and fla's autotuning stay outside the profiled range, which
cudaProfilerStart / Stop bound). Prints nothing of its own but the shape; ncu prints each kernel's figures.
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --csv python3 benchmarks/repro/kda_ncu.py
"""

from __future__ import annotations

import argparse
import os

os.environ["K3_KERNELS"] = "triton"
os.environ["K3_KDA_BWD"] = "triton"
os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla on its Triton path, as in benchmarks/kda.py

import torch

from k3.kernels.kda import chunk_kda

KW = {"use_qk_l2norm_in_kernel": True, "safe_gate": True, "lower_bound": -5.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D")
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args()
    B, T, H, D = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    xs = [torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    xs.append(-5.0 * torch.sigmoid(torch.randn(B, T, H, D, device="cuda")))
    xs.append(torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16))
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    fns = [("k3", chunk_kda)]
    if not args.no_fla:
        from fla.ops.kda import chunk_kda as fla_chunk
        fns.append(("fla", fla_chunk))
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    for _, fn in fns:  # warm-up: compiles and autotuning outside the profiled range
        for _ in range(2):
            fn(*leaves, **KW)[0].backward(do)
    torch.cuda.synchronize()
    print(f"# shape ({B},{T},{H},{D}): one fwd+bwd each of {', '.join(n for n, _ in fns)}, in that order", flush=True)
    torch.cuda.profiler.start()
    for _, fn in fns:
        for x in leaves:  # no accumulation into .grad in the profile (an elementwise add per input)
            x.grad = None
        fn(*leaves, **KW)[0].backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
