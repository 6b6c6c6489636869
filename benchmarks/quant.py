"""int4 quantized matmuls on one GPU: the fused Triton dequant GEMMs (k3kernels/quant/triton.py) against bf16
`torch._grouped_mm` (routed experts) and `torch.matmul` (dense linears) at the same shapes, in one run.

Run on a CUDA machine (never in tests): `python benchmarks/quant.py [--group-size 32] [--tokens 1 4 16 64]`.
Grouped rows: decode-shaped M tokens per expert (every expert gets M rows) through each expert weight, at k3-small's
expert shapes (E = 32, latent 384, width 256) and a large-MoE shape (E = 64, latent 2048, width 1024); gate_up is
[E, 2F, L], down [E, L, F]. Dense rows: k3-small's LM head [32768, 768] and a 2048 x 2048 projection. Columns: the
fused kernel (w4a16) and its w4a8 form (the per-token FP8 activations inside the kernel), the dequantize-then-matmul
twin, and the bf16 anchor; speedup = bf16 / fused; weight GB/s = int4 bytes + fp32 scales read / fused time.
Times are medians of triton.testing.do_bench. Goal (issue 34): >= 3x bf16 at M <= 16 on the large shape.

`--export DIR --tokenizer TOK_DIR [--preset k3-small]` instead writes the releases of the serving rows
(benchmarks/gpu.sh quant): DIR/bf16 (random weights of the preset, the tokenizer's vocab, in bf16), DIR/w4a8 (its routed experts, RTN) and
DIR/w4a16-all (all_linear w4a16), which benchmarks/serve.py then serves one after another.
"""

from __future__ import annotations

import argparse
import datetime
from functools import partial

import torch
import triton
from triton.testing import do_bench

from k3.kernels.quant import quant_grouped_mm_torch, quant_linear_torch, quantize_int4_grouped
from k3.kernels.quant.triton import w4_grouped_mm_triton, w4_linear_triton

GROUPED = {"k3-small": (32, 384, 256), "large": (64, 2048, 1024)}  # E, latent L, expert width F
DENSE = {"k3-small head": (32768, 768), "2048 x 2048": (2048, 2048)}  # N, K


def _us(fn) -> float:
    return do_bench(fn, return_mode="median") * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group-size", type=int, default=32, help="int4 group size (16, 32, 64, 128)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per expert (grouped) and "
                    "rows (dense)")
    ap.add_argument("--export", help="write the serving releases into this directory instead of timing")
    ap.add_argument("--tokenizer", help="with --export: a directory holding tokenizer.json (e.g. runs/tiny/final)")
    ap.add_argument("--preset", default="k3-small", help="with --export: the model preset (random weights)")
    args = ap.parse_args()
    if args.export:
        return export(args.export, args.tokenizer, args.preset, args.group_size)
    dev, bf, g = "cuda", torch.bfloat16, args.group_size
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}; int4 group {g}, bf16 activations")
    print("| shape | weight | M | fused us | w4a8 us | twin us | bf16 us | speedup | weight GB/s | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, (E, L, F) in GROUPED.items():
        for wname, (N, K) in (("gate_up", (2 * F, L)), ("down", (L, F))):
            torch.manual_seed(0)
            w = torch.randn(E, N, K, device=dev) / K ** 0.5
            qw, s = quantize_int4_grouped(w, g)
            w_bf = w.to(bf)
            wbytes = qw.numel() + s.numel() * 4
            for M in args.tokens:
                counts = torch.full((E,), M, device=dev, dtype=torch.int64)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                x = torch.randn(E * M, K, device=dev, dtype=bf)
                y = w4_grouped_mm_triton(x, qw, s, counts)
                err = _rel(y, quant_grouped_mm_torch(x, qw, s, counts, "w4a16"))
                t_f = _us(partial(w4_grouped_mm_triton, x, qw, s, counts))
                t_8 = _us(partial(w4_grouped_mm_triton, x, qw, s, counts, a8=True))
                t_t = _us(partial(quant_grouped_mm_torch, x, qw, s, counts, "w4a16"))
                t_b = _us(partial(torch._grouped_mm, x, w_bf.transpose(-2, -1), offs=offs))
                print(f"| {label} E={E} | {wname} [{N}, {K}] | {M} | {t_f:.1f} | {t_8:.1f} | {t_t:.1f} | {t_b:.1f} | "
                      f"{t_b / t_f:.2f}x | {wbytes / (t_f * 1e-6) / 1e9:.0f} | {err:.1e} |")
    for label, (N, K) in DENSE.items():
        torch.manual_seed(0)
        w = torch.randn(N, K, device=dev) / K ** 0.5
        qw, s = quantize_int4_grouped(w, g)
        w_bf = w.to(bf)
        wbytes = qw.numel() + s.numel() * 4
        for M in args.tokens:
            x = torch.randn(M, K, device=dev, dtype=bf)
            err = _rel(w4_linear_triton(x, qw, s), quant_linear_torch(x, qw, s, "w4a16"))
            t_f = _us(partial(w4_linear_triton, x, qw, s))
            t_8 = _us(partial(w4_linear_triton, x, qw, s, a8=True))
            t_t = _us(partial(quant_linear_torch, x, qw, s, "w4a16"))
            t_b = _us(partial(torch.matmul, x, w_bf.T))
            print(f"| dense {label} | [{N}, {K}] | {M} | {t_f:.1f} | {t_8:.1f} | {t_t:.1f} | {t_b:.1f} | "
                  f"{t_b / t_f:.2f}x | {wbytes / (t_f * 1e-6) / 1e9:.0f} | {err:.1e} |")


def export(out: str, tokenizer: str | None, preset: str, group: int) -> None:
    from pathlib import Path

    from k3.cli.config import load_model_config
    from k3.model.checkpoint import save_release
    from k3.model.transformer import build_model
    from k3.train.quantize import quantize_release

    cfg = load_model_config(preset)
    if tokenizer:  # the vocab of the tokenizer, as benchmarks/serve.py's random releases have
        import dataclasses

        from k3.model.tokenizer import K3Tokenizer

        cfg = dataclasses.replace(cfg, vocab_size=K3Tokenizer.from_file(tokenizer).vocab_size)
    root = Path(out)
    src = save_release(root / "bf16", build_model(cfg, seed=0).state_dict(), cfg, tokenizer_dir=tokenizer,
                       dtype="bfloat16")
    print(src)
    print(quantize_release(src, root / "w4a8", "w4a8", group))
    print(quantize_release(src, root / "w4a16-all", "w4a16", group, modules="all_linear"))
    for d in ("bf16", "w4a8", "w4a16-all"):
        size = sum(f.stat().st_size for f in (root / d).glob("*.safetensors"))
        print(f"{d}: model.safetensors {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
