"""Paged MLA decode on one GPU: the Triton kernel (k3kernels/mla/triton_decode.py) vs its PyTorch twin (gather the
pages, one fp32 softmax), the anchor being what `k3 serve` ran before the kernel existed.

Run on a CUDA machine (never in tests): `python benchmarks/mla_decode.py [--split-keys 256 512]`. k3-small's MLA
sizes (H = 6, C = 256, R = 64), 64-token pages shuffled in a pool, bf16; one decode query per sequence (T = 1) and a
verification window (T = 3); times are medians of triton.testing.do_bench; bandwidth = latent bytes read / time.
`--split-keys` adds a column per key-range length of the split (flash-decoding) path (triton_decode.LAUNCH), timed
in the same run, with its speedup over the single pass.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench

from k3.kernels.mla import triton_decode
from k3.kernels.mla.naive import paged_mla_decode_torch
from k3.kernels.mla.triton_decode import paged_mla_decode_triton

H, C, R, PS = 6, 256, 64, 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split-keys", type=int, nargs="*", default=[], help="key-range lengths (multiples of 64) of "
                    "the split path to time next to the single pass")
    args_cli = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}; H={H} C={C} R={R} page={PS}, bf16")
    splits = "".join(f" split {k} us (x single) |" for k in args_cli.split_keys)
    print("| B | context | T | triton us | twin us | twin / triton | triton GB/s | rel err |" + splits)
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(args_cli.split_keys))
    for B, S, T in ((1, 512, 1), (1, 2048, 1), (1, 8192, 1), (32, 512, 1), (64, 2048, 1), (1, 2048, 3),
                    (32, 2048, 3)):
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
        cells = ""
        for k in args_cli.split_keys:  # the split path on the same inputs, checked against the twin too
            triton_decode.LAUNCH.update(split_keys=k, split_below=1 << 20)
            e_k = ((paged_mla_decode_triton(*args, scale=0.07).float() - ref.float()).norm() / ref.float().norm()).item()
            t_k = do_bench(lambda a=args: paged_mla_decode_triton(*a, scale=0.07), return_mode="median") * 1e3
            triton_decode.LAUNCH.update(split_keys=0)
            cells += f" {t_k:.1f} ({t_tr / t_k:.2f}x{'' if e_k < 2e-2 else f', err {e_k:.1e}'}) |"
        print(f"| {B} | {S} | {T} | {t_tr:.1f} | {t_tw:.1f} | {t_tw / t_tr:.1f} | {gbs:.0f} | {err:.1e} |" + cells,
              flush=True)


if __name__ == "__main__":
    main()
