"""The KDA layer's glue kernels on one GPU: the fused Triton short conv + SiLU and gated RMSNorm against their PyTorch
twins (what the layer ran before), forward and forward + backward, at a model preset's KDA shapes.

    python benchmarks/kda_glue.py                                   # CUDA: k3-small, B = 4, T = 4096, bf16
    python benchmarks/kda_glue.py --device cpu                      # smoke test: k3-debug, B = 1, T = 40, fp32,
                                                                    # the kernels under Triton's interpreter

Rows (C = kda_num_heads * kda_head_dim channels, W = kda_conv_kernel, V = kda_head_dim):
- `conv q,k,v 1 launch`: k3.kernels.conv.triton.causal_conv1d_multi_triton over three [B, T, C] inputs with their
  own [C, W] fp32 weights (one launch each way, as the layer's training path runs it);
- `conv q,k,v 3 launches`: the same kernel once per input (the cost of not grouping them);
- `gated rmsnorm`: k3.kernels.norm.triton.gated_rms_norm_triton on o, gate [B, T, H, V] with an fp32 weight [V].
The twin of the conv rows is `k3.kernels.conv.naive.causal_conv1d_multi` (fp32 cat, shifted multiplies, SiLU through
autograd), of the norm `k3.kernels.norm.naive.gated_rms_norm`. Inputs are bf16 on CUDA (what a layer under bf16
autocast hands over) and fp32 on the CPU. Before timing, each fused output and gradient is compared with the twin's
(rel_rms, kda.md 6.1). Times: medians of triton.testing.do_bench on CUDA (.grad reset outside the timed region), of
a few wall-clock runs on the CPU (the interpreter: no speed meaning). GB/s: the bytes each pass must move at least
(every input read once, every output written once) over the fused time. speedup = twin / fused.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (interpreted smoke test)")
    ap.add_argument("--model", default=None, help="model preset for the shapes (default k3-small; k3-debug on cpu)")
    ap.add_argument("--batch", type=int, default=None, help="B (default 4; 1 on cpu)")
    ap.add_argument("--seq", type=int, default=None, help="T (default 4096; 40 on cpu)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench's timing budget per measurement, ms (CUDA)")
    return ap.parse_args()


def wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    args = parse_args()
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev == "cuda"
    if not cuda:  # before triton is imported: the kernels are decorated as interpreted functions then
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    from triton.testing import do_bench

    from k3.cli.config import load_model_config
    from k3.kernels.conv.naive import causal_conv1d_multi
    from k3.kernels.conv.triton import causal_conv1d_multi_triton
    from k3.kernels.norm.naive import gated_rms_norm
    from k3.kernels.norm.triton import gated_rms_norm_triton

    cfg = load_model_config(args.model or ("k3-small" if cuda else "k3-debug"))
    B, T = args.batch or (4 if cuda else 1), args.seq or (4096 if cuda else 40)
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel
    C, dt = H * K, (torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(0)

    def leaf(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_()

    xs = [leaf(B, T, C) for _ in range(3)]
    ws = [leaf(C, W, dtype=torch.float32, scale=W**-0.5) for _ in range(3)]
    o, gate, nw = leaf(B, T, H, K), leaf(B, T, H, K, scale=2.0), leaf(K, dtype=torch.float32)
    eps = cfg.rms_norm_eps

    def conv_3_launches(xs, ws):
        return tuple(causal_conv1d_multi_triton([x], [w])[0] for x, w in zip(xs, ws))

    elt = torch.finfo(dt).bits // 8
    cases = [  # name, twin, fused, leaves, (bytes fwd, bytes fwd + bwd)
        ("conv q,k,v 1 launch", lambda: causal_conv1d_multi(xs, ws), lambda: causal_conv1d_multi_triton(xs, ws),
         xs + ws, (2 * 3 * B * T * C * elt, 5 * 3 * B * T * C * elt)),  # fwd x, y; bwd again x, dy, dx
        ("conv q,k,v 3 launches", lambda: causal_conv1d_multi(xs, ws), lambda: conv_3_launches(xs, ws),
         xs + ws, (2 * 3 * B * T * C * elt, 5 * 3 * B * T * C * elt)),
        ("gated rmsnorm", lambda: (gated_rms_norm(o, gate, nw, eps),), lambda: (gated_rms_norm_triton(o, gate, nw, eps),),
         [o, gate, nw], (3 * B * T * C * elt, 8 * B * T * C * elt)),  # fwd o, gate, y; bwd o, gate, dy, do, dgate
    ]

    def timed(fn, leaves):
        if cuda:
            return do_bench(fn, warmup=max(25, args.rep // 4), rep=args.rep, grad_to_none=leaves,
                            return_mode="median")
        return statistics.median(wall_ms(fn) for _ in range(3))

    def rel_rms(ref, out):
        ref, out = ref.double(), out.double()
        return ((ref - out).pow(2).mean().sqrt() / (ref.pow(2).mean().sqrt() + 1e-8)).item()

    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    print(f"\nKDA glue kernels, {args.model or cfg.name}: B={B} T={T} H={H} K=V={K} C={C} W={W}, {str(dt)[6:]} "
          f"inputs, fp32 weights; {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}")
    print(f"{'op':<24} {'pass':<8} {'twin ms':>9} {'fused ms':>9} {'speedup':>8} {'fused GB/s':>11} {'rel_rms':>9}")
    for label, twin, fused, leaves, nbytes in cases:
        ys_ref, ys = twin(), fused()
        dys = [torch.randn_like(y) for y in ys]
        errs = [rel_rms(a, b) for a, b in zip(ys_ref, ys)]
        errs += [rel_rms(a, b) for a, b in zip(torch.autograd.grad(ys_ref, leaves, dys),
                                               torch.autograd.grad(ys, leaves, dys))]
        fwd = (timed(twin, None), timed(fused, None))  # with autograd recording, as in a training step

        def train(fn, dys=dys):
            return lambda: torch.autograd.backward(fn(), dys)

        both = (timed(train(twin), leaves), timed(train(fused), leaves))
        for pass_name, (t_twin, t_fused), n in (("fwd", fwd, nbytes[0]), ("fwd+bwd", both, nbytes[1])):
            print(f"{label:<24} {pass_name:<8} {t_twin:>9.3f} {t_fused:>9.3f} {t_twin / t_fused:>7.2f}x "
                  f"{n / t_fused / 1e6:>11.0f} {max(errs):>9.1e}")


if __name__ == "__main__":
    main()
