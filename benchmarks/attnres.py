"""Block AttnRes mixture: the fused Triton kernel (k3.kernels.attnres.triton) against the list-form twin
(k3.kernels.attnres.naive, what the torch backend runs), fwd and fwd + bwd, per source count S.

    python benchmarks/attnres.py                        # CUDA: k3-small's D = 768, B = 4, T = 4096, S = 2..9, bf16
    python benchmarks/attnres.py --first-fp32           # the first source in fp32, as the model's embedding is
    python benchmarks/attnres.py --device cpu           # smoke run: k3-debug, B = 2, T = 16, fp32, the interpreter

Each mixture reads S sources [B, T, D] (random, bf16 on CUDA, fp32 on the CPU) with a gain g [D] and a pseudo-query
w [1, D] (fp32 parameters, non-zero) and returns x [B, T, D]; fwd + bwd also computes the gradients of every source,
g and w for a fixed dx (torch.autograd.grad: nothing accumulates into .grad). On CUDA both run under bf16 autocast,
as in training (the twin's matrix-vector products then run in bf16).

Columns: milliseconds (CUDA: triton.testing.do_bench medians, L2 flushed between calls; CPU: torch.utils.benchmark medians) of
- `twin`: the list form with every source's rms computed in the call;
- `twin*`: the list form with the rms of the S - 1 completed blocks given (computed once, outside the timing, no
  gradient through them): the model computes a completed block's rms once for all the mixtures that read it, so one
  mixture's share of the model's cost lies between twin* and twin;
- `fused`: the Triton kernels (each source's rms inside the pass);
the ratios twin / fused and twin* / fused; the fused kernels' rate over the bytes that must move at least (fwd:
read each source and write x; bwd adds reading dx and each source and writing each dv: the backward reads each source
twice, the second read meant to come from L2); `rel diff`: the largest relative Frobenius difference of x and every
gradient between the fused kernels and the twin.

The last line adds the rows up over the mixtures of one training step of the preset (the source count of each
sub-layer input and the output, architecture.md 4.2): the mixing time a step would spend in each form.
"""

from __future__ import annotations

import argparse
import datetime
import os


def parse_sources(text: str) -> list[int]:
    """'2-9' or '2,5,9' -> the source counts."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def step_source_counts(n_layers: int, block_size: int) -> list[int]:
    """S of every mixture of one forward (K3Backbone.forward's loop): each layer's mixer but layer 0's, each MLP, the
    output."""
    counts, blocks = [], 0
    for i in range(n_layers):
        if blocks:
            counts.append(blocks + 1)
        if i % block_size == 0:
            blocks += 1
        counts.append(blocks + 1)
    return [*counts, blocks + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default where one is visible) or cpu (the smoke run)")
    ap.add_argument("--model", default=None, help="model preset for D and the step's mixtures (default: k3-small on "
                                                  "CUDA, k3-debug on the CPU)")
    ap.add_argument("--batch", type=int, default=None, help="B (default 4 on CUDA, 2 on the CPU)")
    ap.add_argument("--seq", type=int, default=None, help="T (default 4096 on CUDA, 16 on the CPU)")
    ap.add_argument("--sources", default=None, help="source counts, '2-9' or '2,5,9' (default: 2 to the preset's "
                                                    "output count)")
    ap.add_argument("--first-fp32", action="store_true", help="the first source in fp32 (the embedding under "
                                                              "autocast), the others in bf16")
    args = ap.parse_args()

    import torch
    from torch.utils.benchmark import Timer

    cuda_visible = torch.cuda.is_available()
    dev = torch.device(args.device or ("cuda" if cuda_visible else "cpu"))
    cuda = dev.type == "cuda"
    if cuda and not cuda_visible:
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --device cpu for the smoke run")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run as Python on the CPU
        torch.set_num_threads(1)  # tiny tensors: one thread, immune to spin-waits on a shared CPU

    from k3.cli.config import load_model_config
    from k3.kernels.attnres import AttnResSource, attn_res_mix_torch
    from k3.kernels.attnres.triton import attn_res_mix_triton

    name = args.model or ("k3-small" if cuda else "k3-debug")
    cfg = load_model_config(name)
    B, T, D = args.batch or (4 if cuda else 2), args.seq or (4096 if cuda else 16), cfg.d_model
    counts = parse_sources(args.sources) if args.sources else list(range(2, cfg.num_attnres_sources + 1))
    dt = torch.bfloat16 if cuda else torch.float32
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    eps = cfg.rms_norm_eps
    gen = torch.Generator().manual_seed(0)

    def bench(fn) -> float:
        if cuda:
            from triton.testing import do_bench

            return do_bench(fn, warmup=10, rep=100, return_mode="median")
        fn()  # the interpreter's first call of a kernel variant prepares it
        return Timer("fn()", globals={"fn": fn}).timeit(3).median * 1e3

    def row(S: int) -> dict[str, tuple[float, ...]]:
        first = torch.float32 if args.first_fp32 else dt
        vs = [(torch.randn(B, T, D, generator=gen) * (1 + i)).to(dev, first if i == 0 else dt).requires_grad_(True)
              for i in range(S)]
        nw = (1 + 0.1 * torch.randn(D, generator=gen)).to(dev).requires_grad_(True)
        pw = (0.05 * torch.randn(1, D, generator=gen)).to(dev).requires_grad_(True)
        dx = torch.randn(B, T, D, generator=gen).to(dev, vs[0].dtype)
        cached = [AttnResSource(v, eps) for v in vs[:-1]]
        with torch.no_grad():
            for s in cached:
                s.rms_inv  # noqa: B018 - computed now, kept on the source
        inputs = [*vs, nw, pw]

        variants = {
            "twin": lambda: attn_res_mix_torch([AttnResSource(v, eps) for v in vs], nw, pw),
            "twin*": lambda: attn_res_mix_torch([*cached, AttnResSource(vs[-1], eps)], nw, pw),
            "fused": lambda: attn_res_mix_triton(vs, nw, pw, eps),
        }

        def fwd(mix):
            with amp:
                return mix()

        def fwd_bwd(mix):
            return torch.autograd.grad(fwd(mix), inputs, dx)

        out = {}
        results = {k: [fwd(v).detach(), *fwd_bwd(v)] for k, v in variants.items() if k != "twin*"}
        out["rel diff"] = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
                              for a, b in zip(results["fused"], results["twin"], strict=True))
        vb, xb = sum(v.numel() * v.element_size() for v in vs), dx.numel() * dx.element_size()
        unique = {"fwd": vb + xb, "fwd+bwd": (vb + xb) + (xb + 2 * vb)}  # bytes: the sources and x; dx, dv
        for label, run in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            ms = {k: bench(lambda mix=mix, run=run: run(mix)) for k, mix in variants.items()}
            out[label] = (ms["twin"], ms["twin*"], ms["fused"], unique[label] / ms["fused"] / 1e6)
        return out

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    dname = torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)"
    kind = ("fp32 first, bf16" if args.first_fp32 else "bf16") if cuda else "fp32"
    print(f"{stamp}, {dname}, torch {torch.__version__}, {name}: B = {B}, T = {T}, D = {D}, {kind} sources")
    print(f"{'S':>2} {'pass':<8} {'twin ms':>9} {'twin* ms':>9} {'fused ms':>9} {'twin/fused':>11} "
          f"{'twin*/fused':>12} {'fused GB/s':>11} {'rel diff':>9}")
    per_s = {}
    for S in counts:
        r = row(S)
        for label in ("fwd", "fwd+bwd"):
            twin, twin_c, fused, rate = r[label]
            print(f"{S:>2} {label:<8} {twin:>9.3f} {twin_c:>9.3f} {fused:>9.3f} {twin / fused:>10.2f}x "
                  f"{twin_c / fused:>11.2f}x {rate:>11.1f} {r['rel diff']:>9.1e}")
        per_s[S] = r["fwd+bwd"][:3]
    step = step_source_counts(cfg.n_layers, cfg.attn_res_block_size)
    if set(step) <= set(per_s):
        twin, twin_c, fused = (sum(per_s[s][k] for s in step) for k in range(3))
        print(f"one {name} step's {len(step)} mixtures (S = {min(step)}..{max(step)}), fwd+bwd: twin {twin:.2f} ms, "
              f"twin* {twin_c:.2f} ms, fused {fused:.2f} ms ({twin / fused:.2f}x, {twin_c / fused:.2f}x)")


if __name__ == "__main__":
    main()
