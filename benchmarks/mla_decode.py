"""Paged MLA decode on one GPU: the Triton kernel (kernels/mla/triton_decode.py) vs its PyTorch twin (gather the
pages, one fp32 softmax), the anchor being what `k3 serve` ran before the kernel existed.

Run on a CUDA machine (never in tests): `python benchmarks/mla_decode.py`. k3-small's MLA sizes (H = 6, C = 256,
R = 64), 64-token pages shuffled in a pool, bf16; one decode query per sequence (T = 1) and a verification window
(T = 3); times are medians of triton.testing.do_bench; bandwidth = latent bytes read / time.
"""

from __future__ import annotations

import datetime

import torch
import triton
from triton.testing import do_bench

from k3.kernels.mla.naive import paged_mla_decode_torch
from k3.kernels.mla.triton_decode import paged_mla_decode_triton

H, C, R, PS = 6, 256, 64, 64


def main():
    dev, bf = "cuda", torch.bfloat16
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}; H={H} C={C} R={R} page={PS}, bf16")
    print("| B | context | T | triton us | twin us | twin / triton | triton GB/s | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for B, S, T in ((1, 512, 1), (32, 512, 1), (64, 2048, 1), (1, 2048, 3), (32, 2048, 3)):
        torch.manual_seed(0)
        G = S // PS
        pool = torch.randn(B * G + 1, PS, C + R, device=dev, dtype=bf)
        bt = torch.randperm(B * G + 1, device=dev)[: B * G].view(B, G).int()
        q = torch.randn(B, T, H, C, device=dev, dtype=bf)
        qr = torch.randn(B, T, H, R, device=dev, dtype=bf)
        pos = (S - T + torch.arange(T, device=dev)).expand(B, T).contiguous()
        args = (q, qr, pool, bt, pos)
        ref = paged_mla_decode_torch(*args, scale=0.07)
        out = paged_mla_decode_triton(*args, scale=0.07)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        t_tr = do_bench(lambda a=args: paged_mla_decode_triton(*a, scale=0.07), return_mode="median") * 1e3
        t_tw = do_bench(lambda a=args: paged_mla_decode_torch(*a, scale=0.07), return_mode="median") * 1e3
        gbs = B * S * (C + R) * 2 / (t_tr * 1e-6) / 1e9
        print(f"| {B} | {S} | {T} | {t_tr:.1f} | {t_tw:.1f} | {t_tw / t_tr:.1f} | {gbs:.0f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
