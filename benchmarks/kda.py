"""KDA kernel benchmark on one GPU: k3's Triton kernels vs fla-core 0.6.0 (Triton path) vs SDPA causal.

Run on a CUDA machine (never in tests): `python benchmarks/kda.py [--shapes all|small] [--no-fla]
[--only B,T,H,D ...] [--fwd-only] [--no-decode | --decode-only] [--decode-sweep] [--bwd-inter-bk 256 64]
[--bwd-intra-bk 128 64 32] [--bwd-prec bf16x3 tf32 bf16] [--gate-in-kernel] [--set NAME.KEY=VALUE ...]`.
`--only 16,2048,32,64` times just those chunk shapes. `--bwd-inter-bk` / `--bwd-intra-bk` time k3 once per K block
of the backward inter / intra kernel (launch.LAUNCH["bwd_inter" / "bwd_intra"]["BK"]), `--bwd-prec` once
per dot precision of the backward scan and inter kernels, in the same process, one table row per combination;
default: the library defaults.
fla-core is the anchor (kda.md section 7): installed only in the benchmark environment
(`pip install --no-deps fla-core==0.6.0 einops`); FLA_FLASH_KDA=0 keeps fla on its Triton path.

Shapes (B, T, H, D): SHAPES below; bf16 q/k/v, fp32 log gates g = -5 * sigmoid(z) (lower-bound gate range), beta in
(0, 1) bf16; both libraries get use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5. Correctness against
fla is checked (rel_rms of o, kda.md 6.1) before timing. Times are medians of triton.testing.do_bench (CUDA
events); fwd+bwd resets the inputs' .grad before each call, so it times computing the gradients, not adding them into
.grad.

Roofline floor: FLOPs counted per token and head for BT = 64 (fwd: Aqk, L, w, u 2*BT*(3K + 2V); state scan and
inter-chunk output 6*K*V; the 16x16 solve is ignored; fwd+bwd taken as 3x fwd) over the measured bf16 matmul rate,
and the bytes of reading every input and writing every output once over the measured copy bandwidth; the floor is
the larger; "frac" = floor / measured time.
Decode: fused_recurrent_kda, T = 1, state pool updated in place by slot index, all in-kernel flags, one step captured
in a CUDA graph; state bandwidth = (read + write of the fp32 states) / step time.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ["K3_KERNELS"] = "triton"
os.environ.setdefault("K3_KDA_BWD", "triton")  # the Triton backward (K3_KDA_BWD=torch times the PyTorch one)

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from k3.kernels.kda import chunk_kda, fused_recurrent_kda
from k3.kernels.kda.triton import launch

SHAPES = [(8, 4096, 16, 128), (2, 16384, 16, 128), (1, 65536, 16, 128), (16, 2048, 32, 64)]
DECODE_BATCHES = (1, 64, 256)
DEV = "cuda"
BF16 = torch.bfloat16


def rel_rms(ref, out):
    ref, out = ref.float(), out.float()
    return ((ref - out).pow(2).mean().sqrt() / (ref.pow(2).mean().sqrt() + 1e-8)).item()


def bench(fn, ms=300, grad_to_none=None):
    """Median ms of fn. grad_to_none: leaves whose .grad is reset before each call, outside the timed region, so a
    fwd+bwd times the gradients' computation, not their accumulation into .grad (an extra read-add-write of every
    input's gradient: 0.47 ms of both libraries' fwd+bwd at (8, 4096, 16, 128) on the H200)."""
    return do_bench(fn, warmup=max(25, ms // 4), rep=ms, grad_to_none=grad_to_none, return_mode="median")


def ceilings():
    """Measured copy bandwidth (bytes read + written per s) and bf16 matmul rate (FLOP/s)."""
    x = torch.randn(2**28, device=DEV)  # 1 GiB
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x)) * 1e-3
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t_mm = bench(lambda: a @ b) * 1e-3
    return 2 * x.numel() * 4 / t_copy, 2 * 8192**3 / t_mm


def chunk_inputs(B, T, H, D):
    q = torch.randn(B, T, H, D, device=DEV, dtype=BF16)
    k = torch.randn(B, T, H, D, device=DEV, dtype=BF16)
    v = torch.randn(B, T, H, D, device=DEV, dtype=BF16)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, device=DEV))  # fp32 log decay in (-5, 0)
    beta = torch.rand(B, T, H, device=DEV, dtype=BF16)
    return [q, k, v, g, beta]


KW = {"use_qk_l2norm_in_kernel": True, "safe_gate": True, "lower_bound": -5.0}


def time_chunk(fn, xs, do, fwd_only=False):
    """fwd ms, fwd+bwd ms and the fwd+bwd's peak memory above what was allocated before it (GB: what the forward
    keeps for the backward, plus the backward's buffers and the inputs' gradients)."""
    with torch.no_grad():
        t_fwd = bench(lambda: fn(*xs, **KW))
    if fwd_only:
        return t_fwd, float("nan"), float("nan")
    leaves = [x.detach().clone().requires_grad_() for x in xs]

    def fwd_bwd():
        o = fn(*leaves, **KW)[0]
        o.backward(do)

    t_fb = bench(fwd_bwd, ms=600, grad_to_none=leaves)
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return t_fwd, t_fb, (torch.cuda.max_memory_allocated() - base) / 1e9


def time_sdpa(xs, do, fwd_only=False):
    """Causal flash attention at the same B, T, H, D ([B, H, T, D] layout), fwd and fwd+bwd ms."""
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in xs[:3])
    with torch.no_grad():
        t_fwd = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
    if fwd_only:
        return t_fwd, float("nan")
    ql, kl, vl = (x.detach().requires_grad_() for x in (qs, ks, vs))
    dos = do.transpose(1, 2).contiguous()
    t_fb = bench(lambda: F.scaled_dot_product_attention(ql, kl, vl, is_causal=True).backward(dos),
                 grad_to_none=[ql, kl, vl])
    return t_fwd, t_fb


STATE_V_FIRST = False  # --state-v-first: the decode pool as [P, H, V, K] (k3 only)


def decode_inputs(B, H, D):
    """One decode step's inputs at batch B, T = 1, all in-kernel flags: (q, k, v, z, beta logits, keyword arguments
    with the state pool [B, H, D, D] fp32 addressed by slot through ssm_state_indices, reversed so that a kernel
    ignoring the slots computes something else; V-first with STATE_V_FIRST)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 1, H, D, device=DEV, dtype=BF16) for _ in range(3))
    z = torch.randn(B, 1, H, D, device=DEV)
    b = torch.randn(B, 1, H, device=DEV, dtype=BF16)
    A_log, dt_bias = torch.zeros(H, device=DEV), torch.randn(H * D, device=DEV)
    idx = torch.arange(B - 1, -1, -1, device=DEV, dtype=torch.int32)
    kw = {"A_log": A_log, "dt_bias": dt_bias, "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
          "use_beta_sigmoid_in_kernel": True, "lower_bound": -5.0, "ssm_state_indices": idx,
          "initial_state": torch.randn(B, H, D, D, device=DEV)}
    if STATE_V_FIRST:
        kw["state_v_first"] = True
    return (q, k, v, z, b), kw


def decode_check(fns, B, H, D) -> tuple[float, float]:
    """rel_rms of fla's decode step against k3's on the same inputs: (output, state pool after the step); nan when
    fla is missing. Both must update the pool in place by slot (fla: fused_recurrent_kda_fwd, whose default is
    in place; its public fused_recurrent_kda neither writes the state nor reads ssm_state_indices)."""
    if fns[1] is None:
        return float("nan"), float("nan")
    outs = []
    for fn in fns:
        xs, kw = decode_inputs(B, H, D)
        o = fn(*xs, **kw)[0]
        outs.append((o, kw["initial_state"]))
    return rel_rms(outs[0][0], outs[1][0]), rel_rms(outs[0][1], outs[1][1])


def time_decode(fn, B, H, D, name="k3"):
    """µs per decode step of `fn` (fused_recurrent_kda API) at batch B (decode_inputs), the state pool updated in
    place by slot, one step captured in a CUDA graph; nan when fn is None or fails."""
    if fn is None:
        return float("nan")
    xs, kw = decode_inputs(B, H, D)
    try:
        fn(*xs, **kw)  # warm-up: compile, and validate outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*xs, **kw)
        return bench(graph.replay) * 1e3
    except (RuntimeError, TypeError, ValueError) as e:  # report and go on
        print(f"decode {name} B={B} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return float("nan")


def time_inplace(B, H, D):
    """µs per in-place update of a [B, H, D, D] fp32 pool by PyTorch's own elementwise kernel (pool.mul_(-1): read
    and written once, as a decode step does), one step in a CUDA graph: the anchor for a kernel that updates its
    state in place, next to the copy bandwidth (two buffers) that the decode goal is stated against."""
    pool = torch.randn(B, H, D, D, device=DEV)
    pool.mul_(-1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.mul_(-1.0)
    return bench(graph.replay) * 1e3


def decode_sweep(bw: float, H: int = 16, D: int = 128) -> None:
    """The k3 decode kernel at B = 64 and 256 over V blocks and warp counts (triton/recurrent.py's LAUNCH), each row's
    output and pool after one step checked against the default launch's."""
    from k3.kernels.kda.triton import recurrent

    saved = dict(recurrent.LAUNCH)
    print(f"\n## decode sweep: k3 fused_recurrent_kda, H={H}, D={D}; fraction of copy bandwidth")
    print("| B | BV | num_warps | us | fraction | rel_rms o / pool vs default launch |")
    print("|---|---|---|---|---|---|")
    # not swept: 1 warp spills at BV >= 64, and 8 warps lose at every B
    grid = list(itertools.product((32, 64, 128), (2, 4)))

    def step(B):  # one decode step on decode_inputs (seeded): (output, pool after the step)
        xs, kw = decode_inputs(B, H, D)
        return fused_recurrent_kda(*xs, **kw)[0], kw["initial_state"]

    for B in (64, 256):
        recurrent.LAUNCH.update(saved)
        ref = step(B)  # the default launch
        for bv, nw in grid:
            recurrent.LAUNCH.update(BV=bv, num_warps=nw)
            try:  # the same step's results before timing it
                err = [rel_rms(r, x) for r, x in zip(ref, step(B), strict=True)]
            except (RuntimeError, TypeError, ValueError) as e:  # as time_decode: report and go on
                print(f"decode sweep B={B} BV={bv} warps={nw} failed: {type(e).__name__}: {e}", file=sys.stderr)
                err = [float("nan")] * 2
            t = time_decode(fused_recurrent_kda, B, H, D)
            print(f"| {B} | {bv} | {nw} | {t:.1f} | "
                  f"{2 * B * H * D * D * 4 / (t * 1e-6) / bw:.2f} | {err[0]:.1e} / {err[1]:.1e} |", flush=True)
    recurrent.LAUNCH.update(saved)


def floor_ms(B, T, H, D, bw, mm, bwd):
    K = V = D
    tok = B * T * H
    flops = tok * (2 * 64 * (3 * K + 2 * V) + 6 * K * V)
    nbytes = tok * (2 * (2 * K + 2 * V) + 4 * K + 2)  # q, k, v, o bf16; g fp32; beta
    if bwd:
        flops *= 3
        nbytes += tok * (2 * (2 * K + 2 * V) + 4 * K + 2) + tok * (2 * (2 * K + V) + 4 * K + 2)  # reads + grads
    return max(flops / mm, nbytes / bw) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all", choices=["all", "small"])
    ap.add_argument("--only", nargs="+", default=None, metavar="B,T,H,D",
                    help="time only these chunk shapes (e.g. 16,2048,32,64), then decode")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only")
    ap.add_argument("--decode-sweep", action="store_true", help="also sweep the decode kernel's V block and warps")
    ap.add_argument("--no-decode", action="store_true", help="time the chunk shapes only (no decode table)")
    ap.add_argument("--decode-only", action="store_true", help="time decode only (no chunk shapes: fla autotunes "
                    "every new chunk shape for minutes)")
    ap.add_argument("--bwd-inter-bk", nargs="+", type=int, default=None, help="K blocks of the backward inter "
                    "kernel to time side by side (256 = one pass at K <= 256; default: the library default)")
    ap.add_argument("--bwd-intra-bk", nargs="+", type=int, default=None, help="K blocks of the backward intra "
                    "kernel (one program per chunk, head and K block) to time side by side (default: the library's)")
    ap.add_argument("--bwd-prec", nargs="+", choices=launch.INTER_PRECISIONS, default=None,
                    help="dot precisions of the backward scan and inter kernels to time side by side (default: the "
                    "library's)")
    ap.add_argument("--gate-in-kernel", action="store_true", help="pass the raw gate projection z with A_log and "
                    "dt_bias (use_gate_in_kernel=True, the lower-bound gate: the K3 model's call) instead of "
                    "precomputed log gates")
    ap.add_argument("--recompute", action="store_true", help="k3's backward recomputes w, u, v_new and the states "
                    "(K3_KDA_RECOMPUTE=1: less memory, fla's policy) instead of keeping the forward's")
    ap.add_argument("--state-v-first", action="store_true", help="decode with the state pool V-first, [P, H, V, K] "
                    "(each program's state tile contiguous in memory); k3 only, so with --no-fla")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE", help="one k3 kernel's LAUNCH "
                    "entry for the whole run (as kda_tune.py --set, e.g. bwd_inter.EARLY_LOADS=1; repeatable)")
    args = ap.parse_args()
    if args.set:
        from kda_tune import set_launch  # benchmarks/ is the script's directory, so on sys.path

        for item in args.set:
            set_launch(ap, item)
    if args.recompute:
        os.environ["K3_KDA_RECOMPUTE"] = "1"
    if args.state_v_first:
        if not args.no_fla:
            ap.error("--state-v-first times k3 alone (fla's by-slot step reads K-first pools): add --no-fla")
        global STATE_V_FIRST
        STATE_V_FIRST = True
    table = launch.LAUNCH
    default_bks = (table["bwd_inter"]["BK"], table["bwd_intra"]["BK"], table["bwd_inter"]["PREC"])
    bks = list(itertools.product(args.bwd_inter_bk or [default_bks[0]], args.bwd_intra_bk or [default_bks[1]],
                                 args.bwd_prec or [default_bks[2]]))
    fla_chunk = fla_rec = None
    if not args.no_fla:
        try:
            # fla_rec: the in-place, by-slot decode entry point (what serving engines call); the public
            # fused_recurrent_kda passes inplace_final_state=False and swallows ssm_state_indices in **kwargs, so
            # with output_final_state=False it writes no state (fla-core 0.6.0)
            from fla.ops.kda import chunk_kda as fla_chunk
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_rec
        except ImportError as e:
            print(f"fla not importable ({e}); timing k3 alone", file=sys.stderr)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}, FLA_FLASH_KDA={os.environ['FLA_FLASH_KDA']}")
    bw, mm = ceilings()
    print(f"# ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    shapes = SHAPES if args.shapes == "all" else [(2, 1024, 4, 128), (4, 512, 8, 64)]
    if args.only:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.only]
    if args.gate_in_kernel:
        KW["use_gate_in_kernel"] = True
    gates = "raw z, gate in kernel" if args.gate_in_kernel else "precomputed log gates"
    if not args.decode_only:
        print(f"\n## chunk_kda, bf16, {gates}, ms (median); ratio = fla / k3 (> 1: k3 faster); frac = roofline floor / "
              "k3 time")
        print("| shape (B,T,H,D) | k3 bwd BK inter / intra, inter precision | rel_rms vs fla | k3 fwd | fla fwd | "
              "sdpa fwd | fla/k3 fwd | k3 fwd+bwd | fla fwd+bwd | sdpa fwd+bwd | fla/k3 fwd+bwd | frac fwd | "
              "frac fwd+bwd | k3 / fla fwd+bwd peak GB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for B, T, H, D in [] if args.decode_only else shapes:
        torch.manual_seed(0)
        xs = chunk_inputs(B, T, H, D)
        if args.gate_in_kernel:  # z ~ N(0, 1) fp32, A_log and dt_bias as kda.md 6.2's recipe
            xs[3] = torch.randn(B, T, H, D, device=DEV)
            KW.update(A_log=torch.randn(H, device=DEV), dt_bias=torch.randn(H * D, device=DEV))
        do = torch.randn(B, T, H, D, device=DEV, dtype=BF16)
        fla_f = fla_fb = fla_mem = float("nan")
        with torch.no_grad():
            o_fla = fla_chunk(*xs, **KW)[0] if fla_chunk else None
        if fla_chunk:
            fla_f, fla_fb, fla_mem = time_chunk(fla_chunk, xs, do, args.fwd_only)
            print(f"# {datetime.datetime.now():%H:%M:%S} fla ({B},{T},{H},{D}): fwd {fla_f:.3f} ms, fwd+bwd "
                  f"{fla_fb:.3f} ms, peak {fla_mem:.2f} GB", flush=True)
        sd_f, sd_fb = time_sdpa(xs, do, args.fwd_only)
        fl_f, fl_fb = floor_ms(B, T, H, D, bw, mm, False), floor_ms(B, T, H, D, bw, mm, True)
        for bk in bks:  # k3 per (inter, intra) K block pair, same inputs, same process
            table["bwd_inter"]["BK"], table["bwd_intra"]["BK"] = bk[:2]
            table["bwd_scan"]["PREC"] = table["bwd_inter"]["PREC"] = bk[2]
            bk_intra = launch.intra_launch(max(16, triton.next_power_of_2(D)))[0]  # capped at K
            with torch.no_grad():
                o_k3 = chunk_kda(*xs, **KW)[0]
            err = rel_rms(o_fla, o_k3) if o_fla is not None else float("nan")
            k3_f, k3_fb, k3_mem = time_chunk(chunk_kda, xs, do, args.fwd_only)
            print(f"| ({B},{T},{H},{D}) | {bk[0]} / {bk_intra}, {bk[2]} | {err:.2e} | {k3_f:.3f} | {fla_f:.3f} | "
                  f"{sd_f:.3f} | {fla_f / k3_f:.2f} | {k3_fb:.3f} | {fla_fb:.3f} | {sd_fb:.3f} | "
                  f"{fla_fb / k3_fb:.2f} | {fl_f / k3_f:.2f} | {fl_fb / k3_fb:.2f} | {k3_mem:.2f} / {fla_mem:.2f} |",
                  flush=True)
            del o_k3
        table["bwd_inter"]["BK"], table["bwd_intra"]["BK"] = default_bks[:2]
        table["bwd_scan"]["PREC"] = table["bwd_inter"]["PREC"] = default_bks[2]
        del xs, do, o_fla
        torch.cuda.empty_cache()

    if args.no_decode:
        return
    dec = []
    H, D = 16, 128
    for B in DECODE_BATCHES:
        err = decode_check((fused_recurrent_kda, fla_rec), B, H, D)
        res = [time_decode(fn, B, H, D, name) for name, fn in (("k3", fused_recurrent_kda), ("fla", fla_rec))]
        state_bytes = 2 * B * H * D * D * 4  # read and written once per step, by both libraries
        dec.append((B, err, res[0], res[1], [state_bytes / (t * 1e-6) for t in res], time_inplace(B, H, D)))

    print(f"\n## decode: k3 fused_recurrent_kda vs fla fused_recurrent_kda_fwd, H={H}, D={D}, T=1, state pool read and "
          "written in place by slot, one step in a CUDA graph, us per step; rel_rms of fla's output / pool vs k3's")
    print("(in-place anchor: PyTorch's pool.mul_ on a pool of the same size, one step in a CUDA graph)")
    print(f"| B | rel_rms o / pool | k3 us | fla us | in-place anchor us | k3 state GB/s | fla state GB/s | k3 fraction "
          f"of copy bandwidth ({bw / 1e9:.0f} GB/s) | k3 fraction of the in-place anchor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, err, t_k3, t_fla, tbs, t_in in dec:
        print(f"| {B} | {err[0]:.1e} / {err[1]:.1e} | {t_k3:.1f} | {t_fla:.1f} | {t_in:.1f} | {tbs[0] / 1e9:.0f} | "
              f"{tbs[1] / 1e9:.0f} | {tbs[0] / bw:.2f} | {t_in / t_k3:.2f} |")
    if args.decode_sweep:
        decode_sweep(bw)


if __name__ == "__main__":
    main()
