"""QK-Clip's statistic on one GPU: the per-head max causal logit of a training forward, the Triton kernel
(k3.kernels.mla.triton_max_logit) against its PyTorch twin (naive.causal_max_logit_torch: fp32 logits in chunks),
at a model preset's MLA shapes, as GatedMLA calls it (q, k [B, T, H, nope + rope], bf16 under autocast).

    python benchmarks/mla_max_logit.py                   # CUDA: k3-small, B = 4, T = 4096 and 1 x 32768, bf16
    python benchmarks/mla_max_logit.py --device cpu      # smoke test: k3-debug, B = 1, T = 40, fp32, the interpreter

Per shape: twin ms, Triton ms (medians of triton.testing.do_bench on CUDA, of 3 wall-clock runs on the CPU), the
speedup, and the largest difference of the two results (they score the same values; only the summation differs).
A training forward calls it once per MLA layer (k3-small: 4 layers and the MTP's).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (interpreted smoke test)")
    ap.add_argument("--model", default=None, help="model preset for the shapes (default k3-small; k3-debug on cpu)")
    ap.add_argument("--shapes", nargs="*", default=None, help="BxT pairs (default 4x4096 1x32768; 1x40 on cpu)")
    args = ap.parse_args()
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev == "cuda"
    if not cuda:  # before triton is imported: the kernel is decorated as an interpreted function then
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    from triton.testing import do_bench

    from k3.cli.config import load_model_config
    from k3.kernels.mla.naive import causal_max_logit_torch
    from k3.kernels.mla.triton_max_logit import causal_max_logit_triton

    cfg = load_model_config(args.model or ("k3-small" if cuda else "k3-debug"))
    H, E = cfg.mla_num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    default = ["4x4096", "1x32768"] if cuda else ["1x40"]
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default)]
    dt = torch.bfloat16 if cuda else torch.float32
    scale = E ** -0.5

    def timed(fn):
        if cuda:
            return do_bench(fn, warmup=10, rep=100, return_mode="median")
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(runs)

    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    print(f"\nMLA max causal logit, {cfg.name}: H={H} E={E}, {str(dt)[6:]} q, k; {name}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {datetime.date.today()}")
    print(f"{'B':>3} {'T':>7} {'twin ms':>9} {'triton ms':>10} {'speedup':>8} {'max |diff|':>11}")
    torch.manual_seed(0)
    for B, T in shapes:
        q = torch.randn(B, T, H, E, device=dev).to(dt)
        k = torch.randn(B, T, H, E, device=dev).to(dt)
        diff = (causal_max_logit_torch(q, k, scale, 0) - causal_max_logit_triton(q, k, scale, 0)).abs().max().item()
        t_twin = timed(lambda q=q, k=k: causal_max_logit_torch(q, k, scale, 0))
        t_tri = timed(lambda q=q, k=k: causal_max_logit_triton(q, k, scale, 0))
        print(f"{B:>3} {T:>7} {t_twin:>9.3f} {t_tri:>10.3f} {t_twin / t_tri:>7.2f}x {diff:>11.1e}")


if __name__ == "__main__":
    main()
