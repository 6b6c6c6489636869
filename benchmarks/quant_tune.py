"""Launch search for the fused int4 GEMMs (k3kernels/quant/triton.py): every Launch of a grid at benchmarks/quant.py's
shapes, timed against bf16 in one run; prints each shape's fastest launches and the table's current choice.

Run on a CUDA machine (never in tests): `python benchmarks/quant_tune.py [--quick]`. The grid: both operand orders,
BLOCK_N 32-256, 1 or 2 groups per K step, 4 or 8 warps, 1 or 3 pipeline stages; decode rows (M <= 16 per expert) take row tiles of 16, M = 64 32 and
64. The full grids run on the goal's shape
(large gate_up at M = 16 and 64); their `--keep` fastest launches then run at every shape and M. Each launch is
timed with triton.testing.do_bench (median; L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton
from triton.testing import do_bench

from k3.kernels.quant import quantize_int4_grouped
from k3.kernels.quant.triton import Launch, launch_for, w4_grouped_mm_triton, w4_linear_triton

SHAPES = {  # label: (E, N, K); E = 0 is a dense weight
    "large gate_up": (64, 2048, 2048), "large down": (64, 2048, 1024),
    "k3-small gate_up": (32, 512, 384), "k3-small down": (32, 384, 256),
    "k3-small head": (0, 32768, 768),
}


def decode_grid(quick: bool) -> list[Launch]:
    ns = [64, 128] if quick else [32, 64, 128, 256]
    return [Launch(swap, 16, bn, st, w, stages) for swap, bn, st, w, stages in
            itertools.product([True, False], ns, [1, 2], [4, 8], [1, 3]) if swap or bn < 256]


def prefill_grid(quick: bool) -> list[Launch]:
    return [Launch(swap, bm, bn, 1, w, 3) for swap, bm, bn, w in
            itertools.product([False, True], [32, 64], [64, 128], [4, 8] if not quick else [4])]


def run(fn) -> float | None:
    try:
        return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 - a launch the hardware refuses (registers, shared memory) is skipped
        print(f"    skipped: {type(e).__name__}: {str(e)[:100]}")
        return None


class Case:
    """One shape at M rows per expert: its bf16 anchor time and the fused call."""

    def __init__(self, label: str, M: int):
        E, N, K = SHAPES[label]
        dev, bf = "cuda", torch.bfloat16
        torch.manual_seed(0)
        w = torch.randn(max(E, 1), N, K, device=dev) / K ** 0.5
        qw, s = quantize_int4_grouped(w, 32)
        x = torch.randn(M * max(E, 1), K, device=dev, dtype=bf)
        self.label, self.M, self.N, self.K, self.rows, self.E = label, M, N, K, x.shape[0], max(E, 1)
        if E:
            counts = torch.full((E,), M, device=dev, dtype=torch.int64)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            self.call = partial(w4_grouped_mm_triton, x, qw, s, counts)
            self.t_bf = run(partial(torch._grouped_mm, x, w.to(bf).transpose(-2, -1), offs=offs))
        else:
            self.call = partial(w4_linear_triton, x, qw[0], s[0])
            self.t_bf = run(partial(torch.matmul, x, w[0].to(bf).T))

    def search(self, cands: list[Launch], a8: bool, top: int) -> list[tuple[float, Launch]]:
        res = [(t, c) for c in cands if (t := run(partial(self.call, a8=a8, config=c))) is not None]
        res.sort(key=lambda r: r[0])
        table = launch_for(self.rows, self.E)
        t_tab = run(partial(self.call, a8=a8, config=table))
        tab = f"{t_tab:.1f} us ({self.t_bf / t_tab:.2f}x)" if t_tab else "failed"
        print(f"\n## {self.label} [{self.N}, {self.K}], M = {self.M}, {'w4a8' if a8 else 'w4a16'}: bf16 "
              f"{self.t_bf:.1f} us; the table's launch {tab}", flush=True)
        for t, c in res[:top]:
            print(f"| {t:.1f} us | {self.t_bf / t:.2f}x | {c} |", flush=True)
        return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--keep", type=int, default=3, help="launches of each search tried at every other shape")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; group 32")
    # the searches, on the goal shape; their best launches then run at every shape
    dec = [c for _, c in Case("large gate_up", 16).search(decode_grid(args.quick), False, 8)[:args.keep]]
    pre = [c for _, c in Case("large gate_up", 64).search(prefill_grid(args.quick), False, 8)[:args.keep]]
    for label in SHAPES:
        for M in (1, 4, 16, 64):
            case = Case(label, M)
            cands = dec if M <= 16 else pre
            for a8 in (False, True):
                case.search(cands, a8, 3)


if __name__ == "__main__":
    main()
