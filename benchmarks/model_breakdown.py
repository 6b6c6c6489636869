"""Where a K3 training step spends its time: forward wall time per component type (CUDA-synchronised hooks).

    python benchmarks/model_breakdown.py --model k3-small --device cuda --batch 4 --seq 4096

Prints a table of forward ms per component (KDA, MLA, LatentMoE, dense MLP, MTP, head + CE) and the share of the
forward; the backward total is printed as one figure. Profiling aid for choosing which kernel to fuse next.

    python benchmarks/model_breakdown.py --model k3-small --device cuda --batch 4 --seq 4096 --profile-step

adds one whole training step (forward, backward, Muon/AdamW step) under torch.profiler: device time per kernel
category (Triton KDA, fused C2-GLU, grouped expert GEMMs, other GEMMs, attention, elementwise / reductions, copies),
the number of kernels, and device busy time against the step's wall time (a large gap = launch-bound).
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import torch
import torch.nn.functional as F

from k3.cli.config import load_model_config
from k3.model.transformer import build_model
from k3.train.config import OptimConfig
from k3.train.optim import build_optimizer

# kernel name pattern -> category, first match wins (CUDA kernel names from torch.profiler)
CATEGORIES = [
    ("Triton KDA (chunk, recurrent, l2norm)", (r"_intra|_solve_kernel|_wu_kernel|_scan_kernel|_output_kernel|_bwd_|"
                                              r"_recurrent_kda|_l2norm")),
    ("Triton C2-GLU", r"_c2_glu"),
    ("grouped expert GEMM", r"[Gg]rouped|group_gemm|GroupProblemShape"),
    ("GEMM", r"gemm|Gemm|cutlass|xmma|nvjet|cublas|wgmma"),
    ("attention (SDPA)", r"flash|fmha|attention"),
    ("elementwise / reduce", r"elementwise|vectorized|reduce|Reduce|softmax|norm|cat|index|scatter|gather|sort"),
    ("copies / fills", r"[Mm]emcpy|[Mm]emset|copy|fill"),
]


def profile_step(model, cfg, tokens, amp, dev) -> None:
    """One training step (fwd + bwd + optimizer) under torch.profiler after one warm-up step: device time by kernel
    category, kernel count, busy time vs wall time."""
    from torch.profiler import ProfilerActivity, profile

    opt = build_optimizer(model, OptimConfig())
    V = cfg.vocab_size
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        with amp:
            out = model(tokens[:, :-1], mtp_tokens_BT=tokens[:, 1:])
            loss = F.cross_entropy(out.logits.float().reshape(-1, V), tokens[:, 1:].reshape(-1))
            loss = loss + 0.3 * F.cross_entropy(out.mtp_logits.float().reshape(-1, V), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: compile the kernels, allocate the optimizer state
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)  # kernel name -> device time
    calls: dict[str, int] = collections.defaultdict(int)
    ranges: dict[str, float] = collections.defaultdict(float)  # annotated range -> its span on the device timeline
    n_kernels = 0
    busy = 0.0
    for evt in prof.events():
        on_device = evt.device_type.name == "CUDA" if cuda else (evt.key.startswith("aten::") and not evt.cpu_children)
        # user annotations (the optimizers' "Optimizer.step#Muon.step" ranges) also appear on the device timeline;
        # they span kernels counted on their own, so counting them too would double the time
        if on_device and (getattr(evt, "is_user_annotation", False) or evt.key.startswith("Optimizer.")):
            ranges[evt.key] += evt.time_range.elapsed_us() * 1e-6
            continue
        if not on_device:
            continue
        t = evt.time_range.elapsed_us() * 1e-6  # the kernel (or leaf op) duration, µs -> s
        n_kernels += 1
        busy += t
        cat = next((c for c, pat in CATEGORIES if re.search(pat, evt.key)), "other")
        by_cat[cat] += t
        by_name[evt.key] += t
        calls[evt.key] += 1
    print(f"\none training step (fwd + bwd + optimizer): wall {wall * 1e3:.1f} ms, {n_kernels} "
          f"{'kernels' if cuda else 'leaf ops'}, device busy {busy * 1e3:.1f} ms ({busy / wall * 100:.0f}% of wall)")
    print(f"{'category':<40} {'ms':>9} {'share of busy':>14}")
    for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"{k:<40} {v * 1e3:>9.1f} {v / max(busy, 1e-12) * 100:>13.1f}%")
    for name, v in sorted(ranges.items(), key=lambda kv: -kv[1]):
        print(f"range {name}: spans {v * 1e3:.1f} ms of the device timeline ({v / wall * 100:.0f}% of wall)")
    print(f"\n{'top kernels (name cut to 90 characters)':<92} {'calls':>6} {'ms':>8}")
    for name, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]:
        print(f"{name[:90]:<92} {calls[name]:>6} {v * 1e3:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--profile-step", action="store_true", help="also profile one whole training step by kernel "
                    "category")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = load_model_config(args.model)
    model = build_model(cfg, seed=0).to(dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    acc: dict[str, float] = collections.defaultdict(float)
    kinds = {"KimiDeltaAttention": "KDA", "GatedMLA": "MLA", "LatentMoE": "LatentMoE", "MTPModule": "MTP"}

    def pre(mod, inp):
        sync()
        mod._t0 = time.perf_counter()

    def post(mod, inp, out):
        sync()
        acc[kinds.get(type(mod).__name__, "dense MLP")] += time.perf_counter() - mod._t0

    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__ in kinds or (name.endswith(".mlp") and type(mod).__name__ == "GatedMLP"
                                           and not name.startswith("mtp")):
            hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    V = cfg.vocab_size
    tokens = torch.randint(0, V, (args.batch, args.seq + 1), device=dev)
    for it in range(2):
        acc.clear()
        sync()
        t0 = time.perf_counter()
        with amp:
            out = model(tokens[:, :-1], mtp_tokens_BT=tokens[:, 1:])
            loss = F.cross_entropy(out.logits.float().reshape(-1, V), tokens[:, 1:].reshape(-1))
            loss = loss + 0.3 * F.cross_entropy(out.mtp_logits.float().reshape(-1, V), tokens[:, 1:].reshape(-1))
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
    fwd = t1 - t0
    acc["rest (embed, AttnRes, head, CE)"] = fwd - sum(acc.values())
    print(f"\n{args.model} B={args.batch} T={args.seq} on {dev}: forward {fwd * 1e3:.1f} ms, backward "
          f"{(t2 - t1) * 1e3:.1f} ms")
    print(f"{'component':<34} {'fwd ms':>9} {'share':>7}")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"{k:<34} {v * 1e3:>9.1f} {v / fwd * 100:>6.1f}%")
    if args.profile_step:
        for h in hooks:
            h.remove()
        profile_step(model, cfg, tokens, amp, dev)


if __name__ == "__main__":
    main()
