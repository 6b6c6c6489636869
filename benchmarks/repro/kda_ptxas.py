"""Registers and spills of every Triton KDA chunk kernel for an H200 (sm_90a), without a GPU.

Run anywhere Triton is installed (never in tests): `python benchmarks/repro/kda_ptxas.py [--shape K,V,BT]
[--intra-bk 32]`; `--decode`: the recurrent decode kernel instead (decode_launch).
Each kernel is compiled by Triton's own front end for sm_90a with the launch settings of
k3.kernels.kda.triton.launch.LAUNCH and the specialisation a GPU launch gets (pointers 16-byte aligned, T and NT
multiples of 16), then Triton's bundled `ptxas -v` reports registers and spill bytes per thread. Compiled this way,
the kernels' registers match what the H200 reports for the same settings (w/u 148, scan 229-230, output 96, solve
115); without the alignment hints they do not (w/u 255 with 1,148 B spilled). A prediction tool for kernel changes
before a GPU run: spills cost time on the H200, but fewer spills are not always faster (a spill-free intra variant
lost).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("kda_ptxas.py compiles for the GPU: unset TRITON_INTERPRET")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3.kernels.kda.triton import chunk_bwd as B
from k3.kernels.kda.triton import chunk_fwd as F
from k3.kernels.kda.triton import launch as L

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
HALF = {"q", "k", "v", "Aqk", "Mm", "w", "u", "kg", "qg", "vnew", "o", "do", "dv", "dq_out"}  # bf16 tensors of a bf16 run
SCALARS = {"scale": "fp32", "shift": "fp32", "g_floor": "fp32", "lower_bound": "fp32", "T": "i32",
           "NT": "i32", "part_stride": "i32", "aqk_stride": "i32"}
INDEX = {"chunk_indices", "cu_seqlens", "chunk_offsets", "g_ok"}  # int32 pointers


def signature(fn, consts: dict, override: dict) -> dict[str, str]:
    """Triton types of fn's arguments for a bf16 run (fp32 for gates, Gamma, L, Akk, states and gradients)."""
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in override:
            sig[a] = override[a]
        elif a in SCALARS:
            sig[a] = SCALARS[a]
        else:
            sig[a] = "*i32" if a in INDEX else "*bf16" if a in HALF else "*fp32"
    return sig


def ptxas(fn, consts: dict, opts: dict, override: dict | None = None) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread of fn compiled for sm_90a."""
    sig = signature(fn, consts, override or {})
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if sig[a].startswith("*") or a in ("T", "NT", "part_stride", "aqk_stride")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=aligned)
    return ptxas_src(src, opts)


def ptxas_src(src: ASTSource, opts: dict) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread of a kernel source compiled for sm_90a."""
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return regs, int(spills.group(1)), int(spills.group(2))


def decode_launch(bv: int, num_warps: int) -> tuple[ASTSource, dict]:
    """The recurrent kernel of one decode step as benchmarks/kda.py's decode_inputs calls it (bf16 q, k, v and beta
    logits, fp32 z, A_log = 0 and dt_bias, the fp32 pool [B, 16, 128, 128] by reversed slots, every in-kernel flag,
    lower bound -5, T = 1) under recurrent.LAUNCH = {BV, num_warps}: the wrapper runs on CPU tensors with the
    kernel replaced by a recorder, and the recorded arguments are specialised as Triton's launcher does (integers
    equal to 1 become constants, T and the value stride among them; pointers and multiples of 16 get divisibility
    hints). B = 16: the kernel's arguments do not depend on B."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    from k3.kernels.kda.triton import recurrent as R

    fn, seen, saved = R._recurrent_kda_kernel, [], dict(R.LAUNCH)
    B, H, D = 16, 16, 128
    q, k, v = (torch.randn(B, 1, H, D, dtype=torch.bfloat16) for _ in range(3))
    kw = {"A_log": torch.zeros(H), "dt_bias": torch.randn(H * D), "scale": None,
          "initial_state": torch.randn(B, H, D, D), "output_final_state": False, "use_qk_l2norm_in_kernel": True,
          "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "lower_bound": -5.0, "cu_seqlens": None,
          "state_v_first": False, "ssm_state_indices": torch.arange(B - 1, -1, -1, dtype=torch.int32),
          "num_accepted_tokens": None}
    recorder = type("Recorder", (), {"__getitem__": lambda _, grid: lambda *a, **c: seen.append((a, c))})()
    check = R.check_device
    try:
        R.LAUNCH.update(BV=bv, num_warps=num_warps)
        R._recurrent_kda_kernel = recorder
        R.check_device = lambda *_: None  # CPU tensors outside the interpreter: nothing runs
        R.fused_recurrent_kda_triton(q, k, v, torch.randn(B, 1, H, D), torch.randn(B, 1, H, dtype=torch.bfloat16),
                                     **kw)
    finally:
        R._recurrent_kda_kernel = fn
        R.check_device = check
        R.LAUNCH.clear()
        R.LAUNCH.update(saved)
    (args, named), = seen
    specs = [native_specialize_impl(CUDABackend, a, False, True, True) for a in args]
    sig, consts, attrs = {}, {}, {}
    for i, a in enumerate(fn.arg_names):
        kind, attr = specs[i] if i < len(specs) else ("constexpr", None)
        sig[a] = kind
        if kind == "constexpr":
            consts[(i,)] = args[i] if i < len(specs) else named[a]
        elif attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    opts = {key: val for key, val in named.items() if key not in fn.arg_names}
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), opts


def decode_table() -> None:
    """Registers and spills of the decode kernel at the default launches (BV 32 and 64, 4 warps) and BV 32 / 2 warps."""
    print("# Triton " + triton.__version__ + ", sm_90a, the decode step of benchmarks/kda.py (B=256 there: H=16, "
          "K=V=128, T=1, pool by slot, every in-kernel flag); bytes per thread")
    print("| BV | num_warps | registers | spill stores B | spill loads B |")
    print("|---:|---:|---:|---:|---:|")
    for bv, nw in ((32, 4), (64, 4), (32, 2)):
        regs, st, ld = ptxas_src(*decode_launch(bv, nw))
        print(f"| {bv} | {nw} | {regs} | {st} | {ld} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="128,128,64", help="K,V,BT (head dims and chunk size)")
    ap.add_argument("--intra-bk", type=int, default=None, help="K block of the backward intra kernel (default: "
                    "launch.LAUNCH)")
    ap.add_argument("--bwd-prec", choices=L.INTER_PRECISIONS, default=None, help="dot precision of the backward "
                    "scan and inter kernels (default: launch.LAUNCH)")
    ap.add_argument("--bwd-intra-prec", choices=L.INTER_PRECISIONS, default=None, help="dot precision of the backward "
                    "intra kernel's off-diagonal blocks (default: launch.LAUNCH)")
    ap.add_argument("--decode", action="store_true", help="instead: the recurrent decode kernel at the decode step "
                    "of benchmarks/kda.py")
    ap.add_argument("--set", action="append", default=[], metavar="NAME.KEY=VALUE", help="one chunk kernel's LAUNCH "
                    "entry (as kda_tune.py --set), e.g. intra.maxnreg=200; repeatable")
    args = ap.parse_args()
    for item in args.set:
        L.set_launch_entry(item)
    if args.decode:
        decode_table()
        return
    if args.bwd_prec:
        L.LAUNCH["bwd_scan"]["PREC"] = L.LAUNCH["bwd_inter"]["PREC"] = args.bwd_prec
    if args.bwd_intra_prec:
        L.LAUNCH["bwd_intra"]["PREC"] = args.bwd_intra_prec
    K, V, BT = (int(x) for x in args.shape.split(","))
    BK = max(16, triton.next_power_of_2(K))
    heads = {"H": 16, "HV": 16}
    intra = {**heads, "K": K, "BK": BK, "BT": BT, "BC": 16, "NC": BT // 16, "VARLEN": False, "PREC": "tf32"}
    kv = {**heads, "K": K, "V": V, "BK": BK, "BT": BT, "VARLEN": False, "PREC": "tf32"}
    bwd = {**kv, "PREC": L.HALF_INPUT_PRECISION}  # the intra kernel; scan and inter take LAUNCH["PREC"] below
    bv = {name: L.v_block(name, V, BK) for name in ("wu", "scan", "output")}
    bki, intra_bwd_opts = L.intra_launch(BK)
    bki = max(16, min(BK, args.intra_bk)) if args.intra_bk else bki
    bkw = min(BK, L.LAUNCH["wu"]["BK"])  # the w/u kernel's K block
    lfp16 = L.LAUNCH["intra"]["L_FP16"]  # an inference forward's L (with the q / k L2 norm)
    bwd_bv, bwd_opts = L.bwd_scan_launch(V, BK, 1 << 20, 0)  # the reverse scan with many sequences (no halving)
    # the forward's intra kernel in each use: (name, SAFE, STORE_AKK, CHECK_G, STORE_QG)
    intra_uses = [("safe gate (inference: qg for the output fused in the scan)", True, False, True, True),
                  ("safe gate (training: Akk; intermediate states kept, output kernel)", True, True, True, False),
                  ("safe gate (training: Akk, qg for the output fused in the scan)", True, True, True, True),
                  ("exact gate (training)", False, True, False, False)]
    rows = [  # (name, kernel, constexprs, launch options, argument type overrides)
        *[(f"intra, {name}", F._intra_sub_kernel, {**intra, "SAFE": safe, "STORE_AKK": akk, "CHECK_G": check,
                                                   "STORE_QG": qg, "KSPLIT": 1, "Q_RSTD": False},
           L.intra_opts(intra["BK"]),
           {"beta": "*fp32", "Lkk": "*fp16" if lfp16 and not akk else "*fp32"})
          for name, safe, akk, check, qg in intra_uses],
        ("solve (training: from Akk and beta)", F._solve_kernel,
         {"HV": 16, "BT": BT, "BC": 16, "NC": BT // 16, "BETA": True, "VARLEN": False, "PREC": "tf32", "PARTS": 1},
         L.solve_opts(True), {"Mout": "*bf16"}),
        ("solve (inference: from L)", F._solve_kernel,
         {"HV": 16, "BT": BT, "BC": 16, "NC": BT // 16, "BETA": False, "VARLEN": False, "PREC": "tf32", "PARTS": 1},
         L.solve_opts(False), {"Mout": "*bf16", "Lkk": "*fp16" if lfp16 else "*fp32"}),
        # the intra kernel's K split (LAUNCH["intra"]["KSPLIT_FROM"]): one K half a program, the solve adding the halves
        ("intra, safe gate (inference, K split: one half)", F._intra_sub_kernel,
         {**intra, "BK": BK // 2, "SAFE": True, "STORE_AKK": False, "CHECK_G": True, "STORE_QG": True, "KSPLIT": 2,
          "Q_RSTD": bool(L.LAUNCH["intra"]["Q_RSTD"])},
         L.intra_opts(BK // 2), {"beta": "*fp32", "Lkk": "*fp16", "Aqk": "*fp16"}),
        ("solve (inference: two partial L, K split)", F._solve_kernel,
         {"HV": 16, "BT": BT, "BC": 16, "NC": BT // 16, "BETA": False, "VARLEN": False, "PREC": "tf32", "PARTS": 2},
         L.solve_opts(False), {"Mout": "*bf16", "Lkk": "*fp16"}),
        ("w, u (forward)", F._wu_kernel, {**kv, "BK": bkw, "BV": L.wu_launch(V, BK, True)[0], "STORE_QG": False},
         L.wu_launch(V, BK, True)[1], {}),
        ("w, u (backward recompute: qg too)", F._wu_kernel, {**kv, "BK": bkw, "BV": bv["wu"], "STORE_QG": True},
         L.launch_opts("wu"), {}),
        # the forward scan in each use: (name, OUTPUT, STORE_STATES, argument type overrides)
        *[(f"state scan ({name})", F._scan_kernel,
           {**kv, "BV": bv["scan"], "HAS_H0": True, "STORE_HT": True, "OUTPUT": out, "STORE_STATES": st,
            "AQK_PARTS": parts}, L.launch_opts("scan"), over)
          for name, out, st, parts, over in (
              ("bf16 states", False, True, 1, {"hbuf": "*bf16"}),
              ("with the output: inference forward, no states stored", True, False, 1, {}),
              ("with the output, Aqk in two partial sums (K split): inference forward", True, False, 2,
               {"Aqk": "*fp16"}),
              ("with the output and bf16 states: training forward", True, True, 1, {"hbuf": "*bf16"}),
              ("fp32 states: backward", False, True, 1, {}))],
        ("output", F._output_kernel, {**kv, "BV": bv["output"], "AQK_PARTS": 1}, L.launch_opts("output"),
         {"hbuf": "*bf16"}),
        (f"bwd scan ({L.dot_prec('bwd_scan', torch.bfloat16)})", B._bwd_scan_kernel,
         {**bwd, "BK": BK // 2 if BK > 128 else BK, "BV": bwd_bv, "SPLIT": BK > 128,
          "PREC": L.dot_prec("bwd_scan", torch.bfloat16), "HAS_DHT": False, "STORE_DH0": False},
         bwd_opts, {}),
        *[(f"bwd inter ({L.dot_prec('bwd_inter', torch.bfloat16)}{name})", B._bwd_inter_kernel,
           {**{k: v for k, v in bwd.items() if k != "BK"}, "BKB": min(BK, L.LAUNCH["bwd_inter"]["BK"]),
            "BV": L.bwd_v_block("bwd_inter", V), "PREC": L.dot_prec("bwd_inter", torch.bfloat16), "EARLY": early},
           L.launch_opts("bwd_inter"), {})
          for name, early in (("; EARLY 0", 0), ("; EARLY 1: key-side tiles before the V loop", 1),
                              ("; EARLY 2: also v and Akk sooner", 2))],
        *[(f"bwd intra (K block {bki}, off-diagonal {L.dot_prec('bwd_intra', torch.bfloat16)}{name})",
           B._bwd_intra_kernel,
           {**bwd, "BK": bki, "BV": triton.next_power_of_2(V), "BC": 16, "NC": BT // 16, "SAFE": True,
            "OFF": L.dot_prec("bwd_intra", torch.bfloat16), "NORM": norm, "Q_NORM_OUT": q_out}, intra_bwd_opts, {})
          for name, norm, q_out in (("", False, False), ("; the q / k L2 norm's backward in it", True, False),
                                    ("; q's L2-norm backward in it, from the output", False, True))
          if (bki >= K or not norm) and (bki < K or not q_out)],
    ]
    print(f"# Triton {triton.__version__}, sm_90a, K={K}, V={V}, BT={BT}, bf16 inputs; bytes per thread")
    print("| kernel | num_warps | registers | spill stores B | spill loads B |")
    print("|---|---:|---:|---:|---:|")
    for name, fn, consts, opts, override in rows:
        regs, st, ld = ptxas(fn, consts, opts, override)
        print(f"| {name} | {opts['num_warps']} | {regs} | {st} | {ld} |", flush=True)


if __name__ == "__main__":
    main()
