"""Sweep the launch settings of the Triton KDA chunk kernels on a GPU; per-kernel time from torch.profiler.

Run on a CUDA machine (never in tests): `python benchmarks/kda_tune.py [--shape 8,4096,16,128] [--warps 4,8]
[--stages 1,2,3] [--bv 32,64] [--iters 5] [--bwd-inter-bk 64] [--bwd-intra-bk 32] [--bwd-prec bf16x3,tf32,bf16]
[--bwd-intra-prec bf16x3,tf32] [--wu-bk 64] [--scan-bv 32] [--output-from 0] [--scan-stages 2] [--scan-warps 8]
[--set bwd_intra.num_warps=2 ...] [--fwd-only] [--defaults] [--fla]`.
Every configuration (num_warps, num_stages, V block, backward dot precisions) is applied to all forward and
backward kernels at once (k3.kernels.kda.triton.launch.LAUNCH); one fwd+bwd of `chunk_kda` (bf16, lower-bound gates,
in-kernel q/k L2 norm, K3_KDA_BWD=triton) runs `--iters` times under the profiler, and the table gives each kernel's
mean device time per fwd+bwd in microseconds (the w/u and scan kernels run once, in the forward, which keeps its
states; twice with K3_KDA_RECOMPUTE=1 in the environment, the second time in the backward's recompute). "torch ops"
sums every non-Triton kernel (L2 norm, casts, reductions); the inputs' .grad is reset before each fwd+bwd, so it holds
no accumulation into .grad (that add costs 0.47 ms at the default shape). The best configuration per kernel is
starred, and its registers / spilled bytes per thread are printed, so the defaults in LAUNCH can be set from one run.
`--defaults` profiles once with every kernel at its own LAUNCH entry instead of a sweep. `--fla` then profiles
fla-core's chunk_kda on the same inputs, in the same process: its kernels and their time, the stage-by-stage side by
side.
`--set NAME.KEY=VALUE` (repeatable) sets one LAUNCH entry of one kernel (NAME a key of LAUNCH, e.g.
bwd_inter.BV=32), after the sweep flags. `--fwd-only` profiles the inference forward
(no gradients: what benchmarks/kda.py's fwd column times) instead of a fwd+bwd.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import math
import os

os.environ["K3_KERNELS"] = "triton"
os.environ["K3_KDA_BWD"] = "triton"
os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla on its Triton path, as in benchmarks/kda.py

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from k3.kernels.kda import chunk_kda
from k3.kernels.kda.triton import chunk_bwd as bwd_mod
from k3.kernels.kda.triton import chunk_fwd as fwd_mod
from k3.kernels.kda.triton import launch

KERNELS = {"_intra_sub_kernel": (fwd_mod, "intra"), "_solve_kernel": (fwd_mod, "solve"), "_wu_kernel": (fwd_mod, "wu"),
           "_scan_kernel": (fwd_mod, "scan"), "_output_kernel": (fwd_mod, "output"),
           "_bwd_scan_kernel": (bwd_mod, "bwd_scan"), "_bwd_inter_kernel": (bwd_mod, "bwd_inter"),
           "_bwd_intra_kernel": (bwd_mod, "bwd_intra"), "_bwd_dg_kernel": (bwd_mod, "bwd_dg")}
KW = {"use_qk_l2norm_in_kernel": True, "safe_gate": True, "lower_bound": -5.0}


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


DEFAULTS = "defaults"  # the configuration "every kernel at its own LAUNCH entry" (--defaults)


def apply(nw: int, ns: int, bv: int, prec: str, intra_prec: str) -> None:
    launch.LAUNCH["bwd_scan"]["PREC"] = launch.LAUNCH["bwd_inter"]["PREC"] = prec
    launch.LAUNCH["bwd_intra"]["PREC"] = intra_prec
    for _, name in KERNELS.values():
        launch.LAUNCH[name]["num_warps"] = nw
        if "SMALL_K_WARPS" in launch.LAUNCH[name]:  # the forward intra kernel's K <= 64 setting: swept alike
            launch.LAUNCH[name]["SMALL_K_WARPS"] = nw
        if "num_stages" in launch.LAUNCH[name]:
            launch.LAUNCH[name]["num_stages"] = ns
        if "BV" in launch.LAUNCH[name]:
            launch.LAUNCH[name]["BV"] = bv


def set_launch(ap: argparse.ArgumentParser, item: str) -> None:
    """Apply one `--set NAME.KEY=VALUE` (launch.set_launch_entry: an int, True / False, or a string such as
    a dot precision); a bad one is a usage error."""
    try:
        table, key, _ = launch.set_launch_entry(item)
    except ValueError as e:
        ap.error(f"--set {e}")
    name = next(n for n, t in launch.LAUNCH.items() if t is table)
    print(f"# LAUNCH[{name!r}][{key!r}] = {table[key]!r}")


def label(cfg) -> str:
    if cfg == DEFAULTS:
        return "defaults"
    nw, ns, bv, prec, intra_prec = cfg
    return f"w{nw} s{ns} bv{bv} p{prec} ip{intra_prec}"


def device_us(evt) -> float:
    t = getattr(evt, "device_time_total", None)
    return t if t is not None else evt.cuda_time_total


OTHER_OPS: list[collections.Counter] = []  # per profiled configuration: the "torch ops" by kernel name


def profile_once(xs, do, iters: int, fwd_only: bool = False) -> dict[str, float]:
    leaves = [x.detach().clone().requires_grad_() for x in xs]

    def step():
        if fwd_only:  # the inference forward: no Akk, no kept states
            with torch.no_grad():
                chunk_kda(*xs, **KW)
            return
        for x in leaves:  # the gradients themselves, not their accumulation into .grad (an elementwise add each)
            x.grad = None
        chunk_kda(*leaves, **KW)[0].backward(do)

    step()  # compile + warm-up outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per, other = collections.Counter(), collections.Counter()
    for evt in prof.key_averages():
        name = evt.key if evt.key in KERNELS else "torch ops"
        per[name] += device_us(evt) / iters
        if name == "torch ops":
            other[evt.key] += device_us(evt) / iters
    OTHER_OPS.append(other)
    per["total"] = sum(v for k, v in per.items())
    return per


def profile_fla(xs, do, iters: int, fwd_only: bool = False) -> list[tuple[str, float, float]]:
    """fla-core's chunk_kda fwd+bwd (or with `fwd_only` its forward under no_grad, as k3's --fwd-only) on the same
    inputs: [(kernel, us per step, calls per step)], slowest first (fla's autotuning runs in the warm-up, outside
    the profile)."""
    from fla.ops.kda import chunk_kda as fla_chunk

    leaves = [x.detach().clone().requires_grad_() for x in xs]

    def step():
        if fwd_only:
            with torch.no_grad():
                fla_chunk(*xs, **KW)
            return
        for x in leaves:
            x.grad = None
        fla_chunk(*leaves, **KW)[0].backward(do)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, device_us(e) / iters, e.count / iters) for e in prof.key_averages() if device_us(e) > 0]
    return sorted(rows, key=lambda r: -r[1])


def regs_spills(fn_name: str, nw: int, ns: int) -> str:
    """Registers / spilled bytes per thread of the compiled variant with this num_warps / num_stages (best effort:
    reads Triton's in-process compile cache)."""
    mod = KERNELS[fn_name][0]
    fn = getattr(mod, fn_name)
    try:
        for entry in fn.device_caches.values():
            for k in entry[0].values():
                if k.metadata.num_warps == nw and k.metadata.num_stages == ns:
                    return f"{k.n_regs} regs, {k.n_spills} B spilled"
    except (AttributeError, IndexError, TypeError):
        pass
    return "n/a"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--bv", default="32,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--scan-bv", type=int, default=None, help="V block of the two forward state scans only "
                    "(launch.LAUNCH['scan']['BV']; with --defaults the other kernels keep theirs)")
    ap.add_argument("--output-from", type=int, default=None, help="fuse the forward's output into its state scan "
                    "from this many scan programs on (launch.LAUNCH['scan']['OUTPUT_FROM']; 0: always, "
                    "1073741824: never)")
    ap.add_argument("--scan-stages", type=int, default=None, help="num_stages of both state scans (LAUNCH['scan'] "
                    "and ['bwd_scan'] num_stages)")
    ap.add_argument("--scan-warps", type=int, default=None, help="num_warps of both state scans")
    ap.add_argument("--fp32-partials", action="store_true", help="the backward inter kernel's partial dq / dk in "
                    "fp32 (launch.LAUNCH['bwd_inter']['HALF_PARTIALS'] off; bf16 by default)")
    ap.add_argument("--bwd-scan-bv", type=int, default=None, help="V block of the backward's reverse state scan "
                    "(launch.LAUNCH['bwd_scan']['BV'])")
    ap.add_argument("--wu-bk", type=int, default=None, help="K block of the w/u kernel's loop over K "
                    "(launch.LAUNCH['wu']['BK'])")
    ap.add_argument("--defaults", action="store_true", help="one profile with every kernel at its own launch "
                    "defaults (LAUNCH as shipped) instead of the --warps / --stages / --bv / precision sweep")
    ap.add_argument("--bwd-inter-bk", type=int, default=None, help="K block of the backward inter kernel's outer loop "
                    "(launch.LAUNCH; 64 splits K = 128 in two passes)")
    ap.add_argument("--bwd-intra-bk", type=int, default=None, help="K block of the backward intra kernel (one "
                    "program per chunk, head and K block; launch.LAUNCH)")
    ap.add_argument("--fla", action="store_true", help="also profile fla-core's chunk_kda on the same inputs (installed in "
                    "the benchmark environment only), fwd+bwd or with --fwd-only its forward: its kernels, us per step")
    ap.add_argument("--bwd-prec", default=launch.LAUNCH["bwd_inter"]["PREC"], help="dot precisions of the backward "
                    f"scan and inter kernels to sweep, comma-separated, of {launch.INTER_PRECISIONS}")
    ap.add_argument("--bwd-intra-prec", default=launch.LAUNCH["bwd_intra"]["PREC"], help="precisions of the "
                    "backward intra kernel's off-diagonal dots to sweep (its diagonal blocks keep bf16x3)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE", help="one kernel's LAUNCH entry "
                    "(e.g. bwd_intra.num_warps=2, bwd_inter.BV=32; repeatable), applied after the other flags")
    ap.add_argument("--fwd-only", action="store_true", help="profile the inference forward (no gradients)")
    args = ap.parse_args()
    precs, intra_precs = args.bwd_prec.split(","), args.bwd_intra_prec.split(",")
    for p in precs + intra_precs:
        if p not in launch.INTER_PRECISIONS:
            ap.error(f"unknown dot precision {p!r}: use one of {launch.INTER_PRECISIONS}")
    if args.scan_bv:
        launch.LAUNCH["scan"]["BV"] = args.scan_bv
    if args.scan_stages:
        launch.LAUNCH["scan"]["num_stages"] = launch.LAUNCH["bwd_scan"]["num_stages"] = args.scan_stages
    if args.scan_warps:
        launch.LAUNCH["scan"]["num_warps"] = launch.LAUNCH["bwd_scan"]["num_warps"] = args.scan_warps
    if args.fp32_partials:
        launch.LAUNCH["bwd_inter"]["HALF_PARTIALS"] = False
    if args.bwd_scan_bv:
        launch.LAUNCH["bwd_scan"]["BV"] = args.bwd_scan_bv
    if args.output_from is not None:
        launch.LAUNCH["scan"]["OUTPUT_FROM"] = args.output_from
    if args.wu_bk:
        launch.LAUNCH["wu"]["BK"] = args.wu_bk
    if args.bwd_inter_bk:
        launch.LAUNCH["bwd_inter"]["BK"] = args.bwd_inter_bk
    if args.bwd_intra_bk:
        launch.LAUNCH["bwd_intra"]["BK"] = args.bwd_intra_bk
    for item in args.set:
        set_launch(ap, item)
    B, T, H, D = ints(args.shape)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    xs = [torch.randn(B, T, H, D, device=dev, dtype=bf) for _ in range(3)]
    xs.append(-5.0 * torch.sigmoid(torch.randn(B, T, H, D, device=dev)))
    xs.append(torch.rand(B, T, H, device=dev, dtype=bf))
    do = torch.randn(B, T, H, D, device=dev, dtype=bf)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}; shape (B,T,H,D) = ({B},{T},{H},{D}), us per fwd+bwd; "
          f"backward K blocks: inter {launch.LAUNCH['bwd_inter']['BK']}, intra "
          f"{launch.intra_launch(max(16, triton.next_power_of_2(D)))[0]}; "
          "configurations w(arps) s(tages) bv p(scan / inter dot precision) ip(intra off-diagonal dot precision)")
    configs = list(itertools.product(ints(args.warps), ints(args.stages), ints(args.bv), precs, intra_precs))
    if args.defaults:
        configs = [DEFAULTS]
    results = {}
    names = [*KERNELS, "torch ops", "total"]
    print("# per configuration, as measured (us): " + ", ".join(n.strip("_").removesuffix("_kernel") for n in names))
    for cfg in configs:
        if cfg != DEFAULTS:
            apply(*cfg)
        try:
            results[cfg] = profile_once(xs, do, args.iters, args.fwd_only)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile (shared memory) is reported, not fatal
            print(f"# config {label(cfg)} failed: {type(e).__name__}: {e}")
            continue
        row = " ".join(f"{results[cfg].get(n, float('nan')):.0f}" for n in names)
        print(f"# {label(cfg)} at {datetime.datetime.now():%H:%M:%S}: {row}", flush=True)
    ok = [c for c in configs if c in results]
    print("| kernel | " + " | ".join(label(c) for c in ok) + " |")
    print("|---|" + "---:|" * len(ok))
    best = {}
    for n in names:
        vals = [results[c].get(n, float("nan")) for c in ok]
        finite = [(v, c) for v, c in zip(vals, ok, strict=True) if not math.isnan(v) and v > 0]
        if finite:
            best[n] = min(finite)[1]
        cells = [f"{v:.0f}{'*' if n in best and c == best[n] else ''}" for v, c in zip(vals, ok, strict=True)]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n# best per kernel (registers / spills of that variant):")
    for n, (_, name) in KERNELS.items():
        if n in best:
            entry = launch.LAUNCH[name]
            nw, ns = (entry["num_warps"], entry.get("num_stages", 1)) if best[n] == DEFAULTS else best[n][:2]
            if best[n] == DEFAULTS and name == "intra":  # its warps depend on K (intra_opts)
                nw = launch.intra_opts(max(16, triton.next_power_of_2(D)))["num_warps"]
            print(f"#   {n}: {label(best[n])}: {results[best[n]][n]:.0f} us; "
                  f"{regs_spills(n, nw, ns)}")
    if OTHER_OPS:
        print("\n# torch ops of the last configuration, us per fwd+bwd: " + "; ".join(
            f"{name[:60]} {us:.0f}" for name, us in OTHER_OPS[-1].most_common(10)))
    if args.fla:  # where fla's time goes, same inputs and process: the side-by-side per stage
        rows = profile_fla(xs, do, args.iters, args.fwd_only)
        what = "inference forward" if args.fwd_only else "fwd+bwd"
        print(f"\n## fla-core chunk_kda {what} by kernel, us per step (total {sum(r[1] for r in rows):.0f})")
        print("| kernel (name cut to 90) | calls | us |")
        print("|---|---:|---:|")
        for name, us, calls in rows:
            print(f"| {name[:90]} | {calls:.0f} | {us:.0f} |")


if __name__ == "__main__":
    main()
