"""Where a K3 training step spends its time: forward wall time per component type (CUDA-synchronised hooks).

    python benchmarks/model_breakdown.py --model k3-small --device cuda --batch 4 --seq 4096

Prints a table of forward ms per component (KDA, MLA, LatentMoE, dense MLP, MTP, head + CE) and the share of the
forward; the backward total is printed as one figure. Profiling aid for choosing which kernel to fuse next.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F

from k3.cli.config import load_model_config
from k3.model.transformer import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
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

    for name, mod in model.named_modules():
        if type(mod).__name__ in kinds or (name.endswith(".mlp") and type(mod).__name__ == "GatedMLP"
                                           and not name.startswith("mtp")):
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
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


if __name__ == "__main__":
    main()
