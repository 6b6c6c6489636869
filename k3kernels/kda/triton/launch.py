"""Launch settings of the chunkwise KDA kernels (`LAUNCH`) and the helpers that turn them into each launch's options
and block sizes, for the forward (chunk_fwd.py) and the backward (chunk_bwd.py) alike.

LAUNCH is module-level so that benchmarks/kda_tune.py and the tests can change one entry (set_launch_entry).
Triton's num_warps / num_stages as usual; "maxnreg" is ptxas's register cap per thread (0: none); "BV" / "BK" a value /
key block, capped at next_pow2 of the dim. The figures behind a choice are H200 times (132 multiprocessors, Triton
3.6) for bf16 inputs with the q / k L2 norm and the safe gate, per fwd+bwd unless said, at shapes (B, T, H, D).
"""

from __future__ import annotations

import re

import torch
import triton

from ...dispatch import triton_interpreter
from .common import device_sms, fp32_dot_precision

LAUNCH: dict[str, dict[str, int | bool | str]] = {
    # forward: the intra-chunk kernel (intra_fwd.py), one program per (chunk, 16-token sub-chunk, value head)
    "intra": {
        "num_warps": 2,  # 716 us against 908 at 1 warp at (8, 4096, 16, 128)
        "num_stages": 1,  # its walk over the earlier sub-chunks has at most 3 steps: nothing to pipeline
        "SMALL_K_WARPS": 1,  # num_warps at K <= 64: 545 us against 710 at 2 warps at (16, 2048, 32, 64)
        "maxnreg": 0,  # instruction-bound: a register cap spills and loses time (register_cap)
        "L_FP16": True,  # inference L in fp16 (l_in_fp16): 1,289 against 1,347 us a forward at (16, 2048, 32, 64)
        "KSPLIT_FROM": 128,  # K halves from this padded K on (0: never): 531 against 653 us at K = 128, not at 64
        "Q_RSTD": True,  # inference q scaled here by its norm's rstd, no normalised copy: 1,307 against 1,317 us fwd
    },
    # forward: M = (I + L)^-1 (solve.py), one program per (chunk, value head)
    "solve": {
        "num_warps": 1,  # the substitution's row sums stay in one warp: 169 us against 282 at 2 warps, 426 at 4
        "num_stages": 1,  # no loop to pipeline
        "maxnreg": 0,  # inference solve (from L): 102 registers uncapped, which a cap of 112 would only raise
        "TRAIN_MAXNREG": 112,  # training solve (Akk, beta): 133 -> 112 registers, no spills, 138 against 150 us
    },
    # forward: w, u and kg per chunk (chunk_fwd._wu_kernel); also the backward's recompute
    "wu": {
        "num_warps": 4,  # 8 is within noise and faulted on the H200 at K block 16 (a compiler fault)
        "num_stages": 2,  # pipelines the loop over K blocks of heads with K > 128
        "BV": 64,  # the u dot's V block (at least MIN_BV)
        "BK": 128,  # one pass at K <= 128: 688 us against 726 at 64, 744 at 32 (fwd + recompute, (8, 4096, 16, 128))
        "maxnreg": 0,  # the recompute's launch (qg too: 245 registers) uncapped
        "FWD_MAXNREG": 168,  # the forward's launch at K block 128: three programs a multiprocessor, 262 against 308 us
        "FWD_BV": 128,  # and its V block there: 262 us against 281 at 64 (inference forward, (8, 4096, 16, 128))
        "MIN_BV": 64,  # Triton 3.6 miscompiles the u dot at V blocks 16 and 32 (illegal address, or wrong at V = 32)
    },
    # forward: the state scan over each sequence's chunks (chunk_fwd._scan_kernel), output fused in
    "scan": {
        "num_warps": 4,  # the [128, 64] fp32 state tile at 64 registers a thread
        "num_stages": 3,  # next chunks' tiles loaded ahead: 15,681 against 20,480 us at 1 stage at (1, 65536, 16, 128)
        "BV": 64,  # the widest block whose 3 stages fit shared memory in bf16 at K = 128 (216 of 227 KB)
        "OUTPUT_FROM": 0,  # output fused in the scan from this many programs on: 6,242 against 6,418 us unfused
        "INFER_SMALL_K_STAGES": 2,  # inference scan at K <= 64: 230 against 252 us at 3 stages (16, 2048, 32, 64)
        "SMALL_K_STAGES": 2,  # training scan at K <= 64: 88 KB of shared memory, two programs a multiprocessor
        "SEGMENT_CHUNKS": 128,  # time segments of ~128 chunks: fwd 3.727 against 3.949 ms at (1, 65536, 16, 128)
        "SEGMENT_BELOW": 1,  # segments only while the scan runs fewer programs than 1x the multiprocessors
        "SEGMENT_PRIORITY": True,  # segment scans on a high-priority stream: fwd 3.70 against 3.75 ms there
        "maxnreg": 0,  # instruction-bound: a register cap spills and loses time
    },
    # forward: the output from stored states (chunk_fwd._output_kernel), only for return_intermediate_states
    "output": {
        "num_warps": 4,  # one [BT, BV] output tile a program; off the path OUTPUT_FROM 0 times
        "num_stages": 1,  # no loop to pipeline
        "BV": 64,  # as the scan's
        "maxnreg": 0,  # no cap
    },
    # backward: the reverse state scan (chunk_bwd._bwd_scan_kernel)
    "bwd_scan": {
        "num_warps": 4,  # 404 us against 615 at 8 warps
        "num_stages": 3,  # as the forward scan: 1,733 against 3,839 us at 1 stage at (1, 65536, 16, 128)
        "BV": 128,  # one program per sequence and head where the halving leaves it: 5.045 against 5.120 ms at 64
        "PREC": "bf16",  # every factor <= 1 (fla's choice): 786 us against 1,218 in tf32, 1,768 in bf16x3
        "WIDE_WARPS": 8,  # num_warps at V block >= 128: 4 warps spill 596 bytes a thread
        "WIDE_STAGES": 2,  # num_stages there: 208 KB of shared memory; 3 stages do not fit
        "SMALL_K_STAGES": 2,  # at K <= 64 two programs a multiprocessor: 4.584 against 4.611 ms at (16, 2048, 32, 64)
        "maxnreg": 0,  # instruction-bound: a register cap spills and loses time
    },
    # backward: everything but the intra-chunk terms, one program per (chunk, value head) (chunk_bwd._bwd_inter_kernel)
    "bwd_inter": {
        "num_warps": 8,  # 1,844 us against 2,890 at 4 warps
        "num_stages": 1,  # the 1 / 2-stage sweep's choice for its runtime K and V loops
        "BV": 64,  # the inner loop's V block
        "BK": 64,  # halves the per-key accumulators at K = 128: 1,844 us against 2,398-2,444 in one pass
        "PREC": "bf16",  # every factor <= 1 (fla's choice): 1,844 us against 2,525 in tf32, 3,742 in bf16x3
        "HALF_PARTIALS": True,  # partial dq / dk in the inputs' dtype: 268 MB less traffic, 6,053 against 6,139 us
        "EARLY_LOADS": 2,  # loads issued sooner: 1,342 against 1,366 us at (8, 4096, 16, 128), 1,196 against 1,357
        "maxnreg": 0,  # no cap: it spills already
    },
    # backward: the intra-chunk gradients per (chunk, sub-chunk, K block, value head) (intra_bwd._bwd_intra_kernel)
    "bwd_intra": {
        "num_warps": 2,  # with 3 stages and K block 64: 1,319 us against 1,362 for K block 32 at 1 warp, 1 stage
        "num_stages": 3,  # 1,349 us against 1,493 at 1 stage at (16, 2048, 32, 64)
        "BK": 64,  # one launch for every K (at K = 64 a K block holds the head: the L2 norm's backward fuses in)
        "PREC": "tf32",  # off-diagonal dots (fla's precision): bf16 is 1.6% faster but dg's error grows 1.3x
        "Q_NORM_OUT": True,  # q's norm backward here, from the output, when K > BK: 4,947 against 4,972 us
        "maxnreg": 0,  # instruction-bound: a register cap spills and loses time
    },
    # backward: dg = the in-chunk reverse cumsum of dGamma (intra_bwd._bwd_dg_kernel)
    "bwd_dg": {
        "num_warps": 4,  # one [BT, BK] tile a program: a memory-bound pass
        "BK": 64,  # 134 us against 146 at K block 32 at (8, 4096, 16, 128)
        "maxnreg": 0,  # no cap
    },
}


def set_launch_entry(item: str) -> tuple[dict, str, object]:
    """Apply one "NAME.KEY=VALUE" to LAUNCH (VALUE an int, True / False, or a string such as a dot precision) and
    return (that entry's dict, KEY, the value it replaced), so a caller can restore it. benchmarks/kda_tune.py --set
    and the tests' K3_TEST_KDA_LAUNCH take this form. ValueError names the known NAME.KEY pairs."""
    m = re.fullmatch(r"(\w+)\.(\w+)=(\S+)", item.strip())
    if not m or m[1] not in LAUNCH or m[2] not in LAUNCH[m[1]]:
        known = sorted(f"{n}.{k}" for n, e in LAUNCH.items() for k in e)
        raise ValueError(f"{item!r}: expected NAME.KEY=VALUE with NAME.KEY one of {known}")
    raw, table = m[3], LAUNCH[m[1]]
    old = table[m[2]]
    table[m[2]] = {"True": True, "False": False}.get(raw, int(raw) if raw.lstrip("-").isdigit() else raw)
    return table, m[2], old


# --------------------------------------------------------------------------------------------------------------------
# launch options


def entry_opts(entry: dict) -> dict[str, int]:
    """The launch options of one LAUNCH entry: num_warps / num_stages and the register cap where set."""
    return register_cap(entry, {k: v for k, v in entry.items() if k in ("num_warps", "num_stages")})


def launch_opts(name: str) -> dict[str, int]:
    """num_warps / num_stages of kernel `name` (LAUNCH without the block sizes), and its register cap where set."""
    return entry_opts(LAUNCH[name])


def register_cap(entry: dict, opts: dict) -> dict:
    """`opts` with Triton's `maxnreg` (ptxas's register cap per thread) where the LAUNCH entry's "maxnreg" is set (0:
    none, ptxas's own choice). A cap fits more programs on a multiprocessor; under a kernel's need it spills to local
    memory. It pays where the kernel fits without spills (the training solve) or moves bytes (the w/u kernel,
    wu_launch); in the instruction-bound intra, scan and gradient kernels it cost 50-1,500 us on the H200."""
    return {**opts, "maxnreg": entry["maxnreg"]} if entry.get("maxnreg") else opts


def solve_opts(from_akk: bool) -> dict[str, int]:
    """Launch options of the solve: launch_opts, and with `from_akk` (a training forward: Akk and beta) the register
    cap TRAIN_MAXNREG (0: none)."""
    cap = LAUNCH["solve"]["TRAIN_MAXNREG"]
    return {**launch_opts("solve"), "maxnreg": cap} if from_akk and cap else launch_opts("solve")


def scan_opts(states: bool, BK: int) -> dict[str, int]:
    """num_warps / num_stages of the forward scan: at padded key dim BK <= 64, INFER_SMALL_K_STAGES when it stores no
    states (inference), SMALL_K_STAGES when it does."""
    opts = launch_opts("scan")
    if BK > 64:
        return opts
    return {**opts, "num_stages": LAUNCH["scan"]["SMALL_K_STAGES" if states else "INFER_SMALL_K_STAGES"]}


def intra_opts(BK: int) -> dict[str, int]:
    """num_warps / num_stages of the forward intra kernel at padded key dim BK: SMALL_K_WARPS when BK <= 64."""
    opts = launch_opts("intra")
    return {**opts, "num_warps": LAUNCH["intra"]["SMALL_K_WARPS"]} if BK <= 64 else opts


def l_in_fp16(l2norm: bool, dtype: torch.dtype) -> bool:
    """Whether an inference forward stores L in fp16 (LAUNCH["intra"]["L_FP16"]): on bf16 / fp16 inputs whose q and k
    the forward L2-normalises (use_qk_l2norm_in_kernel). Then |L_ij| = beta_i |k_i . k_j| decay <= 1, in fp16's range,
    whose 11-bit significand (relative error 2^-11) is finer than the bf16 the inputs, M and the output are rounded
    to; the solve inverts it in fp32. Raw keys could exceed fp16's 65,504, and fp32 inputs ask for fp32 work."""
    return LAUNCH["intra"]["L_FP16"] and l2norm and dtype in (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------------------------
# forward block sizes and paths


def v_block(name: str, V: int, BK: int) -> int:
    """The V block of forward kernel `name`: LAUNCH's BV, at most next_pow2(V) (>= 16 for tl.dot), 32 when K > 128.
    The w/u kernel takes at least LAUNCH["wu"]["MIN_BV"] (64), whatever K and V (a block past V is masked): at
    V = 128 its launches at V blocks 16 and 32 hit an illegal memory access on the H200 (Triton 3.6), which
    compute-sanitizer places in the u dot: an out-of-bounds read of shared memory that Triton lays out itself, so a
    compiler fault, not our addressing; and at V = 32 (one block of 32) the bf16 / fp16 forward was wrong or hit an
    illegal address (benchmarks/repro/kda_split_check.py). The kernel gains nothing from small blocks (one program per
    chunk loops over them), and its V loop comes after the K loop, so a wide head (K > 128) does not hold both at
    once."""
    bv = max(16, min(LAUNCH[name]["BV"], triton.next_power_of_2(V)))
    if name == "wu":
        return max(bv, LAUNCH["wu"]["MIN_BV"])
    return min(bv, 32) if BK > 128 else bv


def wu_launch(V: int, BK: int, forward: bool) -> tuple[int, dict[str, int]]:
    """(V block, launch options) of the w/u kernel at value dim V, padded key dim BK: v_block and launch_opts, but
    the forward's launch (`forward`: no qg stored) at K block 128 takes LAUNCH["wu"]'s FWD_BV and register cap
    FWD_MAXNREG (0: none), the launch measured with them. The backward's recompute (qg too, 245 registers) keeps the
    plain launch."""
    bv, opts = v_block("wu", V, BK), launch_opts("wu")
    cap = LAUNCH["wu"]["FWD_MAXNREG"]
    if forward and cap and min(BK, LAUNCH["wu"]["BK"]) == 128:
        bv = max(bv, min(LAUNCH["wu"]["FWD_BV"], triton.next_power_of_2(V)))
        opts = {**opts, "maxnreg": cap}
    return bv, opts


def scan_v_block(bv: int, V: int, seq_heads: int, sms: int) -> int:
    """A state scan's V block: `bv` (from v_block), halved (down to 16) while the halved block still runs fewer
    programs (seq_heads * V / bv, seq_heads = N * HV) than the GPU has multiprocessors (`sms`): each program walks
    its sequence's chunks in order, so with few sequences the V blocks are the only parallelism. H200 at
    (1, 65536, 16, 128): 64 -> 128 programs, forward scans 3,135 -> 2,732 us, fwd+bwd 15,681 -> 15,286. At
    (2, 16384, 16, 128) V block 16 would make 256 programs: forward scans 872 -> 1,581 us at 1 stage."""
    while bv > 16 and seq_heads * triton.cdiv(V, bv // 2) < sms:
        bv //= 2
    return bv


def scan_segments(NT: int, programs: int, cu_seqlens, dev: torch.device) -> int:
    """The number of time segments P for chunk_fwd_states (segments.py: the w/u kernel of segment s + 1 overlaps
    the scan of segment s): NT // LAUNCH["scan"]["SEGMENT_CHUNKS"] when that is at least 2, the layout is padded (NT
    chunks in each sequence) and the scan is chain-bound: fewer scan programs than SEGMENT_BELOW x the GPU's
    multiprocessors (always, off a GPU: the interpreter tests); else 0 (one w/u launch, then one scan)."""
    per = LAUNCH["scan"]["SEGMENT_CHUNKS"]
    P = NT // per if per > 0 else 0
    if P < 2 or cu_seqlens is not None:
        return 0
    sms = device_sms(dev)
    return 0 if sms and programs >= LAUNCH["scan"]["SEGMENT_BELOW"] * sms else P


def fuse_output(N: int, HV: int, V: int, K: int, dev: torch.device) -> bool:
    """Whether a forward computes its output inside the state scan (chunk_fwd_states with `o`) rather than in
    `_output_kernel`: when the scan runs at least LAUNCH["scan"]["OUTPUT_FROM"] programs (sequences x value heads
    x V blocks). The fused scan stores no states and no v_new (at inference; a training forward that keeps them for
    its backward stores both, chunk_fwd_pipeline's keep_states), but each step of its sequential loop does the output's
    two dots too; with few programs that loop is the forward's critical path, which costs more than the stores saved
    at 1 stage, but not at 3 (OUTPUT_FROM 0: fused at every shape timed)."""
    BVs = scan_v_block(v_block("scan", V, max(16, triton.next_power_of_2(K))), V, N * HV, device_sms(dev))
    return N * HV * triton.cdiv(V, BVs) >= LAUNCH["scan"]["OUTPUT_FROM"]


# --------------------------------------------------------------------------------------------------------------------
# backward block sizes, dot precisions and dtypes


def q_norm_from_output(H: int, HV: int, K: int) -> bool:
    """Whether the backward intra kernel takes q's L2-norm backward from the forward's output (Q_NORM_OUT): on, with
    q / k heads not shared, where its K block does not hold a head (else the whole norm runs there, NORM). The
    forward reads it to decide whether to keep its output for the backward."""
    BK = max(16, triton.next_power_of_2(K))
    return bool(LAUNCH["bwd_intra"]["Q_NORM_OUT"]) and H == HV and intra_launch(BK)[0] < K


def intra_launch(BK: int) -> tuple[int, dict[str, int]]:
    """(K block, num_warps / num_stages) of the backward intra kernel at padded key dim BK: LAUNCH["bwd_intra"]'s K
    block (at most BK, at least 16)."""
    return max(16, min(BK, LAUNCH["bwd_intra"]["BK"])), launch_opts("bwd_intra")


def bwd_scan_launch(V: int, BK: int, seq_heads: int, sms: int) -> tuple[int, dict[str, int]]:
    """(V block, num_warps / num_stages) of the reverse state scan at padded key dim BK over seq_heads = N * HV
    sequence-heads on `sms` multiprocessors: LAUNCH["bwd_scan"]["BV"] (64 at most when BK > 128: the kernel then holds
    two K halves), halved while the halved block still runs fewer programs than multiprocessors (scan_v_block); a
    block of 128 or more runs WIDE_WARPS / WIDE_STAGES, BK <= 64 SMALL_K_STAGES."""
    bv = bwd_v_block("bwd_scan", V)
    bv = scan_v_block(min(bv, 64) if BK > 128 else bv, V, seq_heads, sms)
    opts = launch_opts("bwd_scan")
    if bv >= 128:
        opts = register_cap(LAUNCH["bwd_scan"], {"num_warps": LAUNCH["bwd_scan"]["WIDE_WARPS"],
                                                 "num_stages": LAUNCH["bwd_scan"]["WIDE_STAGES"]})
    elif BK <= 64:
        opts = {**opts, "num_stages": LAUNCH["bwd_scan"]["SMALL_K_STAGES"]}
    return bv, opts


def bwd_v_block(name: str, V: int) -> int:
    """The V block of backward kernel `name`: LAUNCH's BV, at most next_pow2(V), at least 16 (tl.dot)."""
    return max(16, min(LAUNCH[name]["BV"], triton.next_power_of_2(V)))


HALF_INPUT_PRECISION = "bf16x3"  # the intra kernel's diagonal (anchored) dots for bf16/fp16 inputs (kda.md 3.3)
# the choices of LAUNCH[...]["PREC"]: bf16x3 (three bf16 MMAs, near fp32), tf32 (one, 10-bit mantissas), bf16
# (operands rounded to bf16, one MMA)
INTER_PRECISIONS = ("bf16x3", "tf32", "bf16")


def inter_k_block(BK: int, prec: str) -> int:
    """The inter kernel's K block: LAUNCH["bwd_inter"]["BK"], at most BK (next_pow2(K)), and with tf32x3 dots (fp32
    inputs) at least 32 (or BK when K <= 16: one block, untried on a GPU): at K block 16 of K = 32 (two blocks,
    64-token chunks) that launch read an illegal address on the H200 (Triton 3.6), where ieee and tf32 passed."""
    bkb = min(BK, LAUNCH["bwd_inter"]["BK"])
    return min(BK, max(bkb, 32)) if prec == "tf32x3" else bkb


def dot_prec(name: str, dtype: torch.dtype) -> str:
    """Dot precision of backward kernel `name` (of the intra kernel's off-diagonal dots): for fp32 inputs
    common.fp32_dot_precision() (KernelConfig.kda_fp32_dots, tf32x3 by default); for bf16/fp16, LAUNCH[name]["PREC"]."""
    if dtype == torch.float32:
        return fp32_dot_precision()
    prec = LAUNCH[name]["PREC"]
    if prec not in INTER_PRECISIONS:
        raise ValueError(f"launch.LAUNCH[{name!r}]['PREC'] = {prec!r}; use one of {INTER_PRECISIONS}")
    return interpreted(prec)


def interpreted(prec: str) -> str:
    """`prec` as Triton 3.6's CPU interpreter can run it: it has no bf16x3 (and multiplies every dot in fp32, so
    'ieee' is the same arithmetic), and its bf16 dots are broken (common._dot emulates them)."""
    if not triton_interpreter():
        return prec
    return {"bf16x3": "ieee", "bf16": "bf16_emulated"}.get(prec, prec)


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the inter kernel's partial dq / dk for inputs of `dtype`: fp32, or with LAUNCH["bwd_inter"]
    ["HALF_PARTIALS"] the inputs' half dtype (their one use adds them to the intra kernel's fp32 terms before dq / dk
    are rounded to that dtype anyway)."""
    half = LAUNCH["bwd_inter"]["HALF_PARTIALS"] and dtype in (torch.bfloat16, torch.float16)
    return dtype if half else torch.float32


def recompute_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(hbuf, kg / qg) dtypes the backward reads for inputs of `dtype`. The states entering each chunk: bf16 for bf16
    inputs with bf16 inter dots (which round them to bf16 anyway; the scans carry them in fp32), else fp32. kg = k
    e^(Gamma_last - Gamma) and qg = scale q e^Gamma for the reverse scan: the input dtype when the scan's dots round
    them to it anyway (bf16 dots, or fp32 inputs), else fp32. A training forward keeps its own w, v_new, states,
    kg and qg for the backward only when they have these dtypes (chunk_fwd_pipeline's keep_states)."""
    half_states = dtype == torch.bfloat16 and dot_prec("bwd_inter", dtype) == "bf16"
    kq = dtype if dtype == torch.float32 or dot_prec("bwd_scan", dtype) in ("bf16", "bf16_emulated") else torch.float32
    return (dtype if half_states else torch.float32), kq
