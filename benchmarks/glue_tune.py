"""Launch search for the training step's glue kernels on a GPU, at k3-small's shapes (B x T = 16,384 rows, D = 768,
V = 32,768): the Block AttnRes mixture's backward and forward (k3.kernels.attnres.triton), the RMSNorm forward and
backward (k3.kernels.norm.triton) and the chunked cross-entropy's rows kernel (k3.kernels.loss.triton).

    python benchmarks/glue_tune.py                  # every kernel
    python benchmarks/glue_tune.py --only attnres   # one of attnres | norm | ce

Each row: the launch, the median time (triton.testing.do_bench, L2 flushed between calls) and the rate over the bytes
that must move at least; the current default launch is marked `*`. The table picks the defaults written in each
kernel module's launch constants.
"""

# ruff: noqa: B023 - each launch lambda is timed at once, inside its own loop step
from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench

N, D, V, CHUNK = 16384, 768, 32768, 2048


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def tune_attnres() -> None:
    from k3.kernels.attnres import triton as ar

    print("\n| kernel | S | BT | warps | tiles | ms | GB/s |\n|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator(device="cuda").manual_seed(0)
    nw = torch.rand(D, device="cuda", generator=g) + 0.5
    pw = torch.randn(D, device="cuda", generator=g) * 0.05
    bd = triton.next_power_of_2(D)
    for S in (3, 6, 9):
        vs = tuple(torch.randn(N, D, device="cuda", generator=g).bfloat16() for _ in range(S))
        dx = torch.randn(N, D, device="cuda", generator=g).bfloat16()
        x = torch.empty_like(dx)
        dvs = tuple(torch.empty_like(v) for v in vs)
        for bt, warps in itertools.product((1, 2, 4), (2, 4, 8)):
            fn = lambda: ar._attnres_fwd_kernel[(triton.cdiv(N, bt),)](vs, nw, pw, x, N, D, 1e-5, S=S, BT=bt, BD=bd,
                                                                       num_warps=warps)
            t = ms(fn)
            mark = "*" if (bt, warps) == ar._tile("fwd", D, N)[::2] else ""
            print(f"| fwd{mark} | {S} | {bt} | {warps} | - | {t:.3f} | {(S + 1) * N * D * 2 / t / 1e6:,.0f} |")
        for bt, warps, tiles in itertools.product((1, 2), (2, 4, 8), (4, 16, 64)):
            programs = triton.cdiv(N, bt * tiles)
            part = torch.empty(programs, D, device="cuda")
            fn = lambda: ar._attnres_bwd_kernel[(programs,)](vs, dvs, nw, pw, dx, part, N, D, 1e-5, S=S, BT=bt, BD=bd,
                                                             TILES=tiles, num_warps=warps)
            t = ms(fn)
            cur = ar._tile("bwd", D, N)
            mark = "*" if (bt, warps, tiles) == (cur[0], cur[2], ar.LAUNCH["bwd"]["tiles"]) else ""
            print(f"| bwd{mark} | {S} | {bt} | {warps} | {tiles} | {t:.3f} | {(2 * S + 1) * N * D * 2 / t / 1e6:,.0f} |")


def tune_norm() -> None:
    from k3.kernels.norm import triton as nt

    print("\n| kernel | rows a block | warps | programs (bwd) | ms | GB/s |\n|---|---:|---:|---:|---:|---:|")
    x = torch.randn(N, D, device="cuda").bfloat16()
    dy = torch.randn_like(x)
    w = torch.rand(D, device="cuda") + 0.5
    y, dx = torch.empty_like(x), torch.empty_like(x)
    bv = triton.next_power_of_2(D)
    cur_br = nt._blocks(D)[1]
    for br, warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)):
        fn = lambda: nt._norm_fwd_kernel[(triton.cdiv(N, br),)](x, x, w, y, N, 1e-5, V=D, BV=bv, BR=br, GATE=False,
                                                                num_warps=warps)
        t = ms(fn)
        mark = "*" if (br, warps) == (cur_br, nt.NUM_WARPS) else ""
        print(f"| fwd{mark} | {br} | {warps} | - | {t:.3f} | {2 * N * D * 2 / t / 1e6:,.0f} |")
    for br, warps, programs in itertools.product((1, 2, 4, 8), (2, 4, 8), (256, 1024, 4096)):
        tiles = triton.next_power_of_2(max(1, triton.cdiv(triton.cdiv(N, br), programs)))
        grid = triton.cdiv(N, br * tiles)
        part = torch.empty(grid, D, device="cuda")
        fn = lambda: (nt._norm_bwd_kernel[(grid,)](x, x, w, dy, dx, dx, part, N, 1e-5, V=D, BV=bv, BR=br, TILES=tiles,
                                                   GATE=False, num_warps=warps), part.sum(0))
        t = ms(fn)
        mark = "*" if (br, warps, programs) == (cur_br, nt.NUM_WARPS, nt.BWD_PROGRAMS) else ""
        print(f"| bwd{mark} | {br} | {warps} | {grid} | {t:.3f} | {3 * N * D * 2 / t / 1e6:,.0f} |")


def tune_ce() -> None:
    from k3.kernels.loss import triton as lt

    print("\n| kernel | BV | warps | ms | GB/s |\n|---|---:|---:|---:|---:|")
    z0 = (torch.randn(CHUNK, V, device="cuda") * 3).bfloat16()
    z = z0.clone()
    t = torch.randint(0, V, (CHUNK, 1), device="cuda")
    lpt = torch.empty(CHUNK, 1, device="cuda")
    for bv, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        fn = lambda: lt._ce_rows_kernel[(CHUNK,)](z, t, lpt, V, V=V, BV=bv, GRAD=True, num_warps=warps)
        tm = ms(fn)  # z is overwritten by each call: the values change, the traffic does not
        mark = "*" if (bv, warps) == (lt.BLOCK_V, lt.NUM_WARPS) else ""
        print(f"| rows{mark} | {bv} | {warps} | {tm:.3f} | {3 * CHUNK * V * 2 / tm / 1e6:,.0f} |")
    from k3.kernels.loss.chunked import softmax_rows_torch

    buf = torch.empty(CHUNK, V, device="cuda")
    tm = ms(lambda: softmax_rows_torch(z0.clone(), t, buf, True)) - ms(lambda: z0.clone())
    print(f"| the PyTorch twin (log_softmax, gather, exp, scatter) | - | - | {tm:.3f} | - |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("attnres", "norm", "ce"), default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: the launch search times GPU kernels; run it on a CUDA machine")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, fn in (("attnres", tune_attnres), ("norm", tune_norm), ("ce", tune_ce)):
        if args.only in (None, name):
            fn()


if __name__ == "__main__":
    main()
