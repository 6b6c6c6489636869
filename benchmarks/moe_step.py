"""LatentMoE layer fwd / fwd + bwd and the Muon step: the formulation before issue 36 against the current one, one run.

    python benchmarks/moe_step.py                      # CUDA: k3-small, B = 4, T = 4096, bf16 autocast
    python benchmarks/moe_step.py --device cpu         # smoke run: k3-debug, B = 2, T = 32, fp32
    python benchmarks/moe_step.py --profile            # adds each variant's top kernels (CUDA)

Rows:
- `moe fwd`, `moe fwd+bwd`: one LatentMoE layer of the preset (k3.model.moe, the model's own layer) on x [B, T, D],
  with the upstream gradient fixed. "before" swaps in the earlier dispatch: the permute copies each token K times
  and indexes the copies (its backward is an index_put), and the combine indexes through the inverse order and runs
  one [1, K] x [K, O] torch.bmm per token (a small-tile GEMM in the backward). "now" is k3.kernels.moe as it is:
  gathers both ways and a weighted sum over K.
- `muon step`: Muon.step over the model's Muon parameter groups (k3.train.optim.param_groups_for, as pretraining
  groups them) with fixed random gradients. "before" is the earlier step: fp32 stacks by torch.cat, NS5 with the
  polynomial in elementwise ops, fp32 copies of the updates and unblocking copies. "now" is k3.train.optim.Muon.

Columns: wall ms (median of --iters synchronised calls after --warmup), ratio before / now; on CUDA also device ms
and kernel launches of one profiled call; `max rel diff` is the largest relative Frobenius difference between the
two variants' results (layer output and every gradient; updated parameters), a check that both compute the same
thing (bf16 rounding on CUDA, fp32 rounding on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import statistics
import time
from collections import defaultdict

import torch

import k3.model.moe as moe_module
from k3.cli.config import load_model_config
from k3.model.moe import LatentMoE
from k3.model.transformer import build_model
from k3.train.config import OptimConfig
from k3.train.optim import MOONLIGHT_SCALE, NS5_COEFFS, Muon, build_optimizer

# ------------------------------------------------------------------------------------------ the earlier formulations


def earlier_permute(x_ND, topk_idx_NK, num_experts):
    """moe_permute before issue 36: expand + copy, then index (autograd's backward: index_put with accumulate)."""
    N, K = topk_idx_NK.shape
    flat_M = topk_idx_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat_M.device).scatter_add_(
        0, flat_M, torch.ones_like(flat_M))
    return x_ND.unsqueeze(1).expand(N, K, x_ND.shape[1]).reshape(N * K, -1)[order_M], order_M, counts_E


def earlier_unpermute(y_MO, order_M, topk_weight_NK):
    """moe_unpermute before issue 36: index through the inverse order, then a [1, K] x [K, O] bmm per token."""
    N, K = topk_weight_NK.shape
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(order_M.numel(), device=order_M.device))
    return torch.bmm(topk_weight_NK.to(y_MO.dtype).unsqueeze(1), y_MO[inv_M].view(N, K, -1)).squeeze(1)


@contextlib.contextmanager
def earlier_dispatch():
    """Run LatentMoE.forward with the earlier permute / combine (the layer looks them up in its module)."""
    saved = moe_module.moe_permute, moe_module.moe_unpermute
    moe_module.moe_permute, moe_module.moe_unpermute = earlier_permute, earlier_unpermute
    try:
        yield
    finally:
        moe_module.moe_permute, moe_module.moe_unpermute = saved


def earlier_ns5(G, steps):
    """NS5 before issue 36: bf16 on CUDA with the quintic's terms as separate elementwise ops."""
    a, b, c = NS5_COEFFS
    X = G.to(torch.bfloat16 if G.is_cuda else G.dtype)
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    X = X / (torch.linalg.matrix_norm(X, ord="fro", keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = X @ X.mT
        X = a * X + (b * gram + c * (gram @ gram)) @ X
    return (X.mT if tall else X).to(G.dtype)


def _blocks(x, heads, axis):  # [..., A, B] -> head blocks, as Muon's per-head rule (a copy where not a view)
    if heads is None:
        return x
    *lead, rows, cols = x.shape
    if axis == 0:
        return x.reshape(*lead, heads, rows // heads, cols)
    return x.reshape(*lead, rows, heads, cols // heads).movedim(-2, -3)


def _unblocks(x, shape, heads, axis):
    if heads is None or axis == 0:
        return x.reshape(shape)
    return x.movedim(-3, -2).reshape(shape)


@torch.no_grad()
def earlier_muon_step(opt: Muon) -> None:
    """Muon.step before issue 36 (same math, same state layout): fp32 directions, torch.cat stacks, fp32 updates."""
    todo = []
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        bufs = [opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
        if not params:
            continue
        grads = [p.grad for p in params]
        torch._foreach_mul_(bufs, group["momentum"])
        torch._foreach_add_(bufs, grads)
        dirs = torch._foreach_add(grads, bufs, alpha=group["momentum"]) if group["nesterov"] else bufs
        todo += [(p, group, d) for p, d in zip(params, dirs, strict=True)]
    buckets, views, updates = defaultdict(list), [], [None] * len(todo)
    for i, (_, g, d) in enumerate(todo):
        views.append(_blocks(d, g["num_heads"], g["head_axis"]))
        buckets[(tuple(views[i].shape[-2:]), d.dtype, d.device, g["ns_steps"])].append(i)
    for (ab, _, _, steps), idx in buckets.items():
        flat = [views[i].reshape(-1, *ab) for i in idx]
        ortho = earlier_ns5(flat[0] if len(flat) == 1 else torch.cat(flat), steps) * (MOONLIGHT_SCALE * math.sqrt(max(ab)))
        for i, part in zip(idx, ortho.split([f.shape[0] for f in flat]), strict=True):
            _, g, d = todo[i]
            updates[i] = _unblocks(part.reshape(views[i].shape), d.shape, g["num_heads"], g["head_axis"])
    for group in opt.param_groups:
        mine = [(p, u) for (p, g, _), u in zip(todo, updates, strict=True) if g is group]
        if mine:
            ps = [p for p, _ in mine]
            torch._foreach_mul_(ps, 1.0 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(ps, [u.to(p.dtype) for p, u in mine], alpha=-group["lr"])


# ------------------------------------------------------------------------------------------ measurement


def wall_ms(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_profile(fn) -> tuple[float, int, dict[str, float]]:
    """One profiled call on CUDA: (device busy ms, kernel launches, ms per kernel name)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    n = 0
    for evt in prof.events():
        if evt.device_type.name != "CUDA" or getattr(evt, "is_user_annotation", False):
            continue
        n += 1
        per[evt.key] += evt.time_range.elapsed_us() * 1e-3
    return sum(per.values()), n, per


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ the rows


def moe_rows(cfg, B, T, dev, amp):
    """{row: (before_fn, now_fn)} and the max relative difference of output + gradients (before vs now)."""
    torch.manual_seed(0)
    layer = LatentMoE(cfg).to(dev)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # an autocast block's activations
    x = torch.randn(B, T, cfg.d_model, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(B, T, cfg.d_model, device=dev, dtype=dt)

    def fwd():
        with amp:
            return layer(x)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        fwd().backward(g)

    def results():
        fwd_bwd()
        with torch.no_grad():
            return [fwd().detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    now = results()
    with earlier_dispatch():
        before = results()
    diff = max(rel(b, n) for b, n in zip(before, now, strict=True))

    def earlier(fn):
        def run():
            with earlier_dispatch():
                fn()
        return run

    return {"moe fwd": (earlier(fwd), fwd), "moe fwd+bwd": (earlier(fwd_bwd), fwd_bwd)}, diff


def muon_rows(cfg, dev):
    """{row: (before_fn, now_fn)} over the model's Muon groups, and the max relative difference of one step's change
    of the parameters (before vs now, from the same state)."""
    model = build_model(cfg, seed=0).to(dev)
    opt = build_optimizer(model, OptimConfig())
    muon = opt.muon if hasattr(opt, "muon") else opt
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [p for grp in muon.param_groups for p in grp["params"]]
    for p in params:
        p.grad = torch.randn(p.shape, device=dev, generator=gen)
    start = [p.detach().clone() for p in params]
    muon.step()  # momentum state exists from here on, for both variants
    state = copy.deepcopy(muon.state_dict())
    base = [p.detach().clone() for p in params]

    def changes(step):
        with torch.no_grad():
            for p, b in zip(params, base, strict=True):
                p.copy_(b)
        muon.load_state_dict(copy.deepcopy(state))
        step()
        return [p.detach() - b for p, b in zip(params, base, strict=True)]

    now = changes(muon.step)
    before = changes(lambda: earlier_muon_step(muon))
    diff = max(rel(b, n) for b, n in zip(before, now, strict=True))
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    n = sum(p.numel() for p in params)
    return {"muon step": (lambda: earlier_muon_step(muon), muon.step)}, diff, len(params), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="model preset (default: k3-small on CUDA, k3-debug on the CPU)")
    ap.add_argument("--batch", type=int, default=None, help="B (default 4 on CUDA, 2 on the CPU)")
    ap.add_argument("--seq", type=int, default=None, help="T (default 4096 on CUDA, 32 on the CPU)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per variant (default 20 on CUDA, 3 on CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-muon", action="store_true", help="time the MoE layer only")
    ap.add_argument("--profile", action="store_true", help="print each variant's top kernels by device time")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --device cpu for the smoke run")
    name = args.model or ("k3-small" if cuda else "k3-debug")
    B, T = args.batch or (4 if cuda else 2), args.seq or (4096 if cuda else 32)
    iters = args.iters or (20 if cuda else 3)
    cfg = load_model_config(name)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    rows, diffs = moe_rows(cfg, B, T, dev, amp)
    diffs = {r: diffs for r in rows}
    what = f"N = {B * T} tokens, K = {cfg.num_experts_per_tok}, E = {cfg.num_experts}, latent {cfg.moe_latent_size}"
    if not args.no_muon:
        mrows, mdiff, count, numel = muon_rows(cfg, dev)
        rows.update(mrows)
        diffs["muon step"] = mdiff
        what += f"; Muon over {count} matrices, {numel / 1e6:.1f}M elements"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    dname = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"{stamp}, {dname}, torch {torch.__version__}, {name}: {what}; {'bf16 autocast' if cuda else 'fp32'}")
    head = f"{'row':<12} {'before ms':>10} {'now ms':>9} {'ratio':>7}"
    if cuda:
        head += f" {'dev before':>11} {'dev now':>9} {'dev ratio':>10} {'launches':>13}"
    print(head + f" {'max rel diff':>13}")
    tops = {}
    for row, (before, now) in rows.items():
        t_before, t_now = wall_ms(before, iters, args.warmup, cuda), wall_ms(now, iters, args.warmup, cuda)
        line = f"{row:<12} {t_before:>10.2f} {t_now:>9.2f} {t_before / t_now:>6.2f}x"
        if cuda:
            (d_before, n_before, top_b), (d_now, n_now, top_n) = device_profile(before), device_profile(now)
            tops[row] = (top_b, top_n)
            line += f" {d_before:>11.2f} {d_now:>9.2f} {d_before / d_now:>9.2f}x {n_before:>6}/{n_now:<6}"
        print(line + f" {diffs[row]:>13.2e}")
    if args.profile:
        for row, variants in tops.items():
            for label, top in zip(("before", "now"), variants, strict=True):
                print(f"\n{row}, {label}: top kernels by device ms")
                for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:10]:
                    print(f"  {v:>8.3f}  {k[:100]}")


if __name__ == "__main__":
    main()
