"""Chunkwise KDA forward as Triton kernels (`chunk_kda` on the "triton" backend); backward in triton_chunk_bwd.py.

Legend: N sequences, T_all total tokens (B * T, or the packed varlen length), H q/k heads, HV value heads, K key dim,
V value dim, BT chunk size (16/32/64), BC = 16 sub-chunk, NC = BT / BC, NT_all chunks over all sequences,
BK = next_pow2(K), BV value block. Every tensor is addressed as [T_all, heads, dim] (B folded into T).

Pipeline (kda.md section 3.2; equations of section 3.1 in log2 units, Gamma = chunk-local cumsum(g) / ln 2):
1. `_intra_sub_kernel` (triton_common.py), one program per (chunk, 16-token sub-chunk s, value head), the whole K
   at once: Gamma [T_all, HV, K] fp32 (one walk over the earlier sub-chunks' g gives their decay to the anchor and
   the carry into s); the rows of sub-chunk s of Aqk = scale * q k^T with decay (j <= i) and of L = diag(beta) k k^T
   with decay (j < i), both [T_all, HV, BT]:
     off-diagonal (columns of earlier sub-chunks): one dot with the anchor Gamma_n = first row of sub-chunk s,
       query factor exp2(Gamma_i - Gamma_n) <= 1, key factor exp2(Gamma_n - Gamma_j) <= 1 (kda.md 3.3);
     diagonal 16 x 16 block: with `safe_gate` one dot with the fixed anchor C = Gamma_n - (BC - 1) s / 2 (in log2
       units), s = -lower_bound (2 if unset), so appending tokens cannot move C; otherwise exact pairwise exponents,
       one column at a time in fp32 (any g, including -1000).
   (Tried and measured on an H200, then removed: one program per (chunk, head) over all sub-chunks, in several
   forms (block-by-block Gamma re-reads, reloaded tiles, register-held Gamma: 1,003-1,046 us at (8, 4096, 16, 128)
   against this kernel's 800 at 2 warps, session 8), one program per 16-row sub-chunk looping over K blocks
   ("rows"), and steps 1 and 2 in one kernel with L kept in registers: benchmarks/RESULTS.md sessions 2-8.)
2. `_solve_kernel` (triton_solve.py): M = (I + L)^-1 by fp32 forward substitution on the diagonal 16 x 16 blocks
   (all of a chunk's at once) and block-inverse merges M_ij = -M_ii sum_{j <= m < i} L_im M_mj (kda.md 3.2 step 2b).
3. `_wu_kernel` (triton_fwd_kernels.py, as 4 and 5): w = M (beta k exp2(Gamma)), u = M (beta v), and
   kg = k exp2(Gamma_last - Gamma) for the scan (in the backward's recompute also qg = scale q exp2(Gamma) for the
   reverse scan).
4. `_scan_kernel`, one program per (V block, sequence, value head), sequential over the sequence's chunks:
   h[c] = state entering chunk c; v_new = u - w h; h <- Diag(exp2(Gamma_last)) h + kg^T v_new. With fewer
   programs than multiprocessors and long sequences, steps 3 and 4 run in time segments, the w/u kernel of the next
   segment during the scan of this one (LAUNCH["scan"]["SEGMENT_CHUNKS"], triton_segments.py).
5. `_output_kernel`: o = (scale q exp2(Gamma)) h[c] + Aqk v_new. Or, when the scan runs enough programs
   (fuse_output; not with return_intermediate_states), inside the scan's loop from the state in registers: the
   intra kernel stores qg = scale q exp2(Gamma), and neither h[c] nor v_new is written or read back (unless a
   training forward keeps them for its backward: keep_states).
Intermediates (Aqk, M, w, u, v_new) are stored in the input dtype (fp32 for fp32 inputs), Gamma and the states in
fp32 except h[c], which is stored in the input dtype unless `return_intermediate_states` asks for it (fp32); L in
fp32, or in fp16 at inference on bf16 / fp16 inputs with the q / k L2 norm (l_in_fp16).

Backward: `_ChunkKDATriton.backward` runs the Triton backward (triton_chunk_bwd.py). A forward that needs gradients
(grad mode on and an input requiring grad) has the intra kernel store Akk = k k^T with decay (no beta, fp32) in place
of L (STORE_AKK; the solve applies beta to its row sums) and keeps Gamma, Aqk, Akk and M, and by default
(keep_states) also w, kg, qg, and v_new and the states, which its fused scan then stores too; with
K3_KDA_RECOMPUTE=1 the backward recomputes those (steps 3 and 4, `chunk_fwd_states`). It then runs the reverse state
scan, inter-chunk and intra-chunk gradient kernels.
Per token and value head this keeps Gam 4K bytes + Aqk 2 BT + Akk 4 BT + M 2 BT (bf16 inputs; the last three 512
bytes together at BT = 64) in place of g's 4K, as fla-core 0.6.0 does (its `ChunkKDAFunction` saves the gate cumsum,
Aqk and Akk and recomputes w, u and h in its backward), plus by default the states' 1,536 bytes at K = V = 128
(keep_states; u not among them: the backward takes v_new = u - w h instead). A forward without gradients
(inference) stores no Akk and keeps nothing.
K3_KDA_BWD, read by the forward, selects the backward: "triton" (default; triton_chunk_bwd.py, tested under the
interpreter in fp32 and on an H200 in fp32 and bf16) or "torch", for which the forward keeps q, k, v, g, beta, h0
(not Gamma, Aqk, Akk, M) and the backward recomputes the forward with the PyTorch implementation (chunk.py,
hand-written blockwise backward) and returns its gradients, at PyTorch speed.
The in-kernel steps run around the core under autograd: the q/k L2 norm and the gate as one Triton pass each way
(triton_l2norm.py, triton_gate.py), the beta sigmoid as a PyTorch op.
float64 inputs (the reference precision) run on the PyTorch implementation.
"""

from __future__ import annotations

import os

import torch
import triton

from ..dispatch import check_device
from .chunk import SAFE_GATE_FLOOR, SUB_CHUNK, chunk_kda_torch
from .triton_common import (
    _intra_sub_kernel,
    _layout_args,
    device_sms,
    fp32_dot_precision,
    launch_fitting,
)
from .triton_fwd_kernels import _output_kernel, _scan_kernel, _wu_kernel
from .triton_gate import kda_gate_triton
from .triton_l2norm import l2norm_bwd_from_y, l2norm_fwd
from .triton_segments import run_segments, segment_tables
from .triton_solve import _solve_kernel

RCP_LN2 = 1.4426950408889634  # 1 / ln 2: every exp becomes exp2 (kda.md 3.2 step 1)

# Launch settings per forward kernel: Triton's num_warps / num_stages, and the V block "BV" (capped at
# next_pow2(V), and at 32 when K > 128). Module-level so benchmarks/kda_tune.py can sweep them on a GPU.
LAUNCH: dict[str, dict[str, int]] = {  # tuned on an H200 at (8, 4096, 16, 128) bf16, 2026-11-29 (RESULTS.md)
    # `_intra_sub_kernel`: 716 us per fwd+bwd at 2 warps, 908 at 1 (8, 4096, 16, 128; session 9; ~1,540 at 4 in
    # session 8's two-pass form). SMALL_K_WARPS: num_warps when K <= 64 (intra_opts): at (16, 2048, 32, 64) 545 us
    # at 1 warp (session 11) against 710 at 2 (session 10's call 4, the same kernel; RESULTS.md)
    # The q/k L2 norm's work moved into this kernel lost four times: q and k normalised here (session 12), q alone
    # (13), rows scaled by precomputed inverse norms at inference (14: this kernel +66-86 us, the norm passes -63),
    # every loaded row normalised here with rstd stored and k's rows scaled in the w/u kernel (16: this kernel +225 /
    # +266 us at K = 128 / 64 against the 146 us pass saved)
    # L_FP16: an inference forward's L = diag(beta) k k^T with decay stored in fp16 (l_in_fp16): the intra kernel
    # writes and the solve reads half the bytes. H200, inference forward, us, fp32 / fp16 L (kda_tune.py --fwd-only,
    # 2026-11-30, RESULTS.md session 21): (16, 2048, 32, 64) intra 560 / 513, solve 122 / 109, total 1,347 / 1,289;
    # (8, 4096, 16, 128) solve 63 / 57, total 1,441 / 1,433
    # KSPLIT_FROM: with fp16 L, the intra kernel in two K halves from this padded key dim on (0: never), as programs
    # of their own at the halved dim's launch (1 warp at 64), the solve adding their partial L, Aqk's reader (the
    # scan, or the output kernel) their partial Aqk (in the solve: +55 us at (8, 4096, 16, 128)): at K = 128
    # the 1-warp K = 64 kernel ran the same number of programs in 519 us (at (16, 2048, 32, 64)) where the 2-warp
    # K = 128 one takes 653 (at (8, 4096, 16, 128); session 21). H200, inference forward, us (kda_tune.py
    # --fwd-only, 2026-12-01, RESULTS.md session 22), whole -> halves: (8, 4096, 16, 128) intra 653 -> 531, solve
    # 58 -> 82, scan 290 -> 309 (Aqk's two parts), total 1,397 -> 1,315, 1,318; (2, 16384) 1,759 -> 1,690;
    # (1, 65536) 4,310 -> 4,266; issue 4's table, fwd ms at (8, 4096, 16, 128): 1.313, 1.319 against 1.412 (fla
    # 1.69). At K = 64 (halves of 32) intra 518 -> 618. Halves at 2 warps: 674. So from 128 (K = 128 heads). Session
    # 22 left it off after a bf16 forward at K = 64, V = 32 came out wrong on the H200; session 23 found that wrong
    # whole or in halves, at V = 32 only: the w/u kernel's V block of 32 (now at least 64, v_block). Every bf16
    # case of benchmarks/kda_split_check.py then passed, and so did the GPU tests in halves (RESULTS.md session 23).
    # With the halves adjacent in the launch (triton_common._intra_sub_kernel) the intra kernel took 527 us, not 556;
    # issue 4's table then gave fwd 1.292 ms at (8, 4096, 16, 128) (fla 1.686)
    # (Tried and removed: each pair of halves adding its partial sums itself, the second to finish (an atomic
    # arrival count) storing part 0 + part 1 over part 0, so that the solve and the scan read one part: solve 82 ->
    # 58 us, scan 309 -> 300, but intra 527 -> 607, total 1,283 -> 1,331 at (8, 4096, 16, 128) (H200, kda_tune.py
    # --fwd-only, 2026-12-01, RESULTS.md session 23))
    # Q_RSTD: an inference forward's q L2-normalised by the intra kernel, which scales its rows by the norm pass's
    # rstd (that pass then reads q and stores no copy; the intra kernel's own rows only, not the walk's, unlike
    # session 14's form). H200, inference forward, us, off / on (kda_tune.py --fwd-only, 2026-12-01, RESULTS.md
    # session 22): (8, 4096, 16, 128) with the K split, intra 532 / 552, totals in two calls 1,318, 1,316, 1,317,
    # 1,316 / 1,307, 1,308, 1,305, 1,307; (16, 2048, 32, 64) intra 519 / 533, total 1,284 / 1,270
    "intra": {"num_warps": 2, "num_stages": 1, "SMALL_K_WARPS": 1, "maxnreg": 0, "L_FP16": True, "KSPLIT_FROM": 128,
              "Q_RSTD": True},
    # 1 warp: the forward substitution's row reductions stay inside the warp (ptxas, sm_90a: 21 barriers against
    # 510 at 2 warps): 169 us per fwd+bwd, 282 at 2 warps, 426 at 4 (session 8); 65 us with the diagonal blocks
    # inverted together (session 9)
    # TRAIN_MAXNREG: the training solve's register cap (solve_opts; from Akk and beta, 133 registers at 1 warp): 112
    # fits without spills (ptxas, sm_90a), 18 programs per multiprocessor in place of 15. H200, (16, 2048, 32, 64)
    # fwd+bwd, this kernel (kda_tune.py, 2026-11-30, RESULTS.md session 19): 150 us uncapped, 138 at 112 (139 in a
    # second run, 145 at 104), 162 at 96 (8 bytes spilled). The inference solve (from L) takes 102 registers
    # uncapped, 19 programs; a cap of 112 would grow it to 112 (ptxas), so it runs uncapped
    # (Tried and removed: each diagonal block inverted as (I + X)(I + X^2)(I + X^4)(I + X^8), X = -L_ii, six tf32 dots
    # in place of the substitution walk: 18% fewer instructions (ptxas, sm_90a) but 116 against 101 registers, and
    # on the H200 this kernel 122 -> 129 us at (16, 2048, 32, 64), 63 -> 67 at (8, 4096, 16, 128), inference
    # forward (kda_tune.py, 2026-11-30, RESULTS.md session 21))
    # (Tried and removed: the inference solve's six blocks below the diagonal loaded before the substitution walk
    # rather than after it (their loads issue after the walk in program order; SASS, sm_90a): 102 -> 142 registers,
    # and on the H200 this kernel 81 -> 104 / 105 us at (8, 4096, 16, 128) with the K split, 109 -> 134 at (16, 2048,
    # 32, 64) (kda_tune.py --fwd-only, 2026-12-01, RESULTS.md session 23): fewer programs per multiprocessor hide less)
    "solve": {"num_warps": 1, "num_stages": 1, "maxnreg": 0, "TRAIN_MAXNREG": 112},
    # BK: the w/u kernel's K block (its loop over K). H200, (8, 4096, 16, 128), forward + the backward's recompute:
    # 688 us at 128 (one pass), 726 at 64, 744 at 32, though 64 / 32 take 128 / 79 registers against 180 (session
    # 9); heads with K > 128 go in blocks of 128
    # 8 warps: fwd -8 / -11 / -45 / -8 us at (8,4096,16,128) / (2,16384,16,128) / (1,65536,16,128) / (16,2048,32,64)
    # against 4 (kda.py, 2026-11-30, RESULTS.md session 17, call 1), -5 / -18 us at the long shapes with segments
    # (call 3): within noise; and at K block 16 (K = 32, V = 32) the 8-warp launch hit an illegal memory access on the
    # H200 (GPU test test_chunk_gradients_with_the_wu_kernel_in_k_blocks, call 3), a compiler fault like the small V
    # blocks' below (v_block): 4 warps kept
    # FWD_MAXNREG / FWD_BV: the forward's launch (no qg) at K block 128 (wu_launch): ptxas's register cap (180 -> 168
    # registers, 28 bytes spilled: three 4-warp programs per multiprocessor in place of two) and its V block.
    # H200, inference forward at (8, 4096, 16, 128), this kernel (kda_tune.py --fwd-only, 2026-11-30, RESULTS.md
    # session 19): 308 us uncapped; capped at 168: 281 at V block 64 (also at 1 or 3 stages, or V block 32), 262 at
    # V block 128; capped at 200: 308, at 144: 294, at 128 with 8 warps: 285; 452 -> 421 at (2, 16384, 16, 128) (in
    # time segments). At K = 64 (96 registers) a cap changes nothing (292 against 289 at (16, 2048, 32, 64))
    # Gamma from g here at K <= 64 (tl.cumsum and tl.sum over the chunk's rows, for an inference forward whose intra
    # kernel then stores Gamma at the chunks' last rows only) lost: H200, (16, 2048, 32, 64) inference forward,
    # intra / this kernel / total us, twice each (kda_tune.py --fwd-only, 2026-11-30, RESULTS.md session 20): 565 /
    # 291 / 1,344 and 565 / 292 / 1,343 without, 538 / 341 / 1,365 and 538 / 341 / 1,366 with: removed. The same
    # with the cumsum as a lower-triangular ones matrix times g on the tensor cores (g in two fp16 or three bf16
    # parts, exact to ~22 / 24 bits) lost too: this kernel 296 -> 319 / 361 us, total 1,282 -> 1,300 (session 21)
    # v loaded with k, Gamma and M at K <= 64 (one V block) rather than after the w part: 1,300 / 1,432 us against
    # 1,301 / 1,430 at (16, 2048, 32, 64) / (8, 4096, 16, 128) (in the run of the PDL chain, LAUNCH's end): removed
    # MIN_BV: the w/u kernel's V block floor, whatever V (v_block): its u dot at V block 32 with 16-bit operands is
    # miscompiled on the H200 at V = 32 too (Triton 3.6): bf16 / fp16 inference forwards at K = 64 / 128, V = 32
    # were off by rel_rms 0.6 / 0.77 or hit an illegal address (benchmarks/kda_split_check.py, RESULTS.md session 23)
    "wu": {"num_warps": 4, "num_stages": 2, "BV": 64, "BK": 128, "maxnreg": 0, "FWD_MAXNREG": 168, "FWD_BV": 128,
           "MIN_BV": 64},
    # scan: the scans run 3 stages: their tl.range loops load the next chunks' tiles ahead through shared memory
    # (cp.async; bf16, sm_90a, 16-byte aligned as launched: 116-216 KB per program at V block 32 / 64, against 28-80
    # KB at 1 stage; RESULTS.md session 11); H200 per fwd+bwd at 1 / 3 stages
    # (kda_tune.py --defaults --scan-stages, session 11): (8,4096,16,128) 6,214 -> 6,139 us; (16,2048,32,64)
    # 6,429 -> 6,266; (2,16384,16,128) 7,983 -> 6,802; (1,65536,16,128) 20,480 -> 15,681. Per kernel at 1 / 2 / 3
    # stages (2026-11-30, RESULTS.md session 11): forward scans 1,522 / 1,100 / 865 and backward scan 1,012 / 639 /
    # 495 at (2, 16384, 16, 128); 5,799 / 4,149 / 3,147 and 3,839 / 2,336 / 1,733 at (1, 65536, 16, 128)
    # The state in two [64, BV] K halves (as fla's state kernel holds it) took 313 us per scan against 299, and 361
    # at V block 32 (H200, 2026-11-30, RESULTS.md session 10): removed
    # OUTPUT_FROM: the forward's output computed inside the scan from this many scan programs on (fuse_output).
    # H200, us per fwd+bwd, fused / separate output kernel (kda_tune.py --defaults, 2026-11-30, RESULTS.md session
    # 10): (8, 4096, 16, 128), 256 programs: 6,242 / 6,418; (16, 2048, 32, 64), 512: 6,499 / 6,627; but
    # (2, 16384, 16, 128), 128 programs at V block 32: 7,882 / 7,859; (1, 65536, 16, 128), 64: 20,683 / 20,144.
    # With 3 stages there (session 11): 6,587 / 6,802 and 15,420 / 15,681, so 0: always (the output kernel only
    # for return_intermediate_states)
    # Two-level scans (segments of 8 / 16 / 32 chunks) tried, removed: (1,65536,16,128) 19,393 / 17,076 / 15,941 us
    # against 15,681 one-level at 3 stages; (2,16384,16,128) 9,687 / 8,592 / 8,067 against 6,802 (session 11)
    # Steps 3 and 4 as one kernel (the scan computing each chunk's w, u and kg itself) tried, removed: 1,300 us at 4
    # warps against 311 + 437 for the two kernels at (2,16384,16,128) on the H200, and wrong at 8 warps with 64-token
    # chunks (RESULTS.md session 14)
    # INFER_SMALL_K_STAGES: num_stages of the inference forward's scan (output fused, no states or v_new stored) at
    # K <= 64 (scan_opts). H200, us per inference forward, scan at 3 / 2 stages (kda_tune.py --fwd-only, 2026-11-30,
    # RESULTS.md session 15): (16, 2048, 32, 64) 252 / 230; but (8, 4096, 16, 128) 295 / 392, (2, 16384, 16, 128)
    # 443 / 642
    # SMALL_K_STAGES: num_stages of the training forward's scan (states stored) at K <= 64 (V block 64: 128 KB of
    # shared memory at 3 stages, one program per multiprocessor; 88 KB at 2, two): fwd+bwd -15 us alone, -43 with the
    # reverse scan's (triton_chunk_bwd.LAUNCH["bwd_scan"]) at (16, 2048, 32, 64) (RESULTS.md session 17, call 5)
    # SEGMENT_CHUNKS: the w/u kernel and the scan in time segments of about this many chunks per sequence (NT //
    # SEGMENT_CHUNKS segments, at least 2; 0: off), the w/u of segment s + 1 on a side stream during the scan of
    # segment s (scan_segments, triton_segments.py), when the scan runs fewer programs than SEGMENT_BELOW x the GPU's
    # multiprocessors. H200, fwd ms at 0 / 2 / 4 / 8 segments (kda.py --set scan.SEGMENTS, 2026-11-30, RESULTS.md
    # session 17, call 1): (2, 16384, 16, 128), 256 chunks, 128 programs: 1.629 / 1.575 / 1.581 / 1.591;
    # (1, 65536, 16, 128), 1,024 chunks, 64 programs: 3.949 / 3.904 / 3.782 / 3.727; 128 chunks a segment is the
    # best of both rows. Calls 3-4 measured 1.580 / 1.586 ms at (2, 16384, 16, 128), call 5 1.646 (the unsegmented
    # time). SEGMENT_PRIORITY puts the scans on a high-priority stream (run_segments says why). H200, fwd ms in three
    # runs each, without / with (session 18, call 1): (2, 16384, 16, 128) 1.584 1.585 1.591 / 1.583 1.584 1.583;
    # (1, 65536, 16, 128) 3.745 3.750 3.778 / 3.705 3.703 3.701: every run with it at or below the best without
    # An inference forward's batch in 2 / 4 parts on streams of their own (INFER_BATCH_PARTS, session 16) lost: fwd
    # 1.486 -> 1.545 / 1.747 ms at (8, 4096, 16, 128), 1.374 -> 1.403 / 1.721 at (16, 2048, 32, 64) (session 17,
    # call 1): removed
    "scan": {"num_warps": 4, "num_stages": 3, "BV": 64, "OUTPUT_FROM": 0, "INFER_SMALL_K_STAGES": 2,
             "SMALL_K_STAGES": 2, "SEGMENT_CHUNKS": 128, "SEGMENT_BELOW": 1,
             "SEGMENT_PRIORITY": True, "maxnreg": 0},
    "output": {"num_warps": 4, "num_stages": 1, "BV": 64, "maxnreg": 0},
    # (Tried and removed: the intra kernel, the solve, the w/u kernel and the scan chained by programmatic dependent
    # launch on the H200, each program signalling its successor at entry and waiting on its predecessor: inference
    # forward 1,285 -> 1,300 us at (16, 2048, 32, 64), 1,409 -> 1,432 at (8, 4096, 16, 128), the waiting programs
    # slowing the w/u kernel and the scan by ~13 us each (kda_tune.py --fwd-only, 2026-11-30, RESULTS.md session 21))
}


def l_in_fp16(l2norm: bool, dtype: torch.dtype) -> bool:
    """Whether an inference forward stores L in fp16 (LAUNCH["intra"]["L_FP16"]): on bf16 / fp16 inputs whose q and k
    the forward L2-normalises (use_qk_l2norm_in_kernel). Then |L_ij| = beta_i |k_i . k_j| decay <= 1, in fp16's range,
    whose 11-bit significand (relative error 2^-11) is finer than the bf16 the inputs, M and the output are rounded
    to; the solve inverts it in fp32. Raw keys could exceed fp16's 65,504, and fp32 inputs ask for fp32 work."""
    return LAUNCH["intra"]["L_FP16"] and l2norm and dtype in (torch.bfloat16, torch.float16)


def launch_opts(name: str) -> dict[str, int]:
    """num_warps / num_stages of kernel `name` (LAUNCH without the block sizes), and its register cap where set."""
    return entry_opts(LAUNCH[name])


def entry_opts(entry: dict) -> dict[str, int]:
    """The launch options of one LAUNCH entry (this module's or triton_chunk_bwd's): num_warps / num_stages and the
    register cap where set."""
    return register_cap(entry, {k: v for k, v in entry.items() if k in ("num_warps", "num_stages")})


def register_cap(entry: dict, opts: dict) -> dict:
    """`opts` with Triton's `maxnreg` (ptxas's register cap per thread) where the LAUNCH entry's "maxnreg" is set (0:
    none, ptxas's own choice). A cap fits more programs on a multiprocessor; under a kernel's need it spills to local
    memory. H200 (RESULTS.md session 19): it paid where the kernel fits without spills (the solve) or moves bytes
    (the w/u kernel, wu_launch), and lost 50-1,500 us in the instruction-bound intra, scan and gradient kernels."""
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


def v_block(name: str, V: int, BK: int) -> int:
    """The V block of kernel `name`: LAUNCH's BV, at most next_pow2(V) (>= 16 for tl.dot), 32 when K > 128.
    The w/u kernel takes at least LAUNCH["wu"]["MIN_BV"] (64), whatever K and V (a block past V is masked): at
    V = 128 its launches at V block 16 (session 8) and 32 (4 warps, 1 stage; session 10) hit an illegal memory access
    on the H200 (Triton 3.6, 2026-11-30), which compute-sanitizer places in the u dot both times: an out-of-bounds
    read of shared memory that Triton lays out itself (benchmarks/kda_wu_bv16.py), so a compiler fault, not our
    addressing; and at V = 32 (one block of 32) the bf16 / fp16 forward was wrong or hit an illegal address (session
    23). The kernel gains nothing from small blocks (one program per chunk loops over them), and its V loop comes
    after the K loop, so a wide head (K > 128) does not hold both at once."""
    bv = max(16, min(LAUNCH[name]["BV"], triton.next_power_of_2(V)))
    if name == "wu":
        return max(bv, LAUNCH["wu"]["MIN_BV"])
    return min(bv, 32) if BK > 128 else bv


def wu_launch(V: int, BK: int, forward: bool) -> tuple[int, dict[str, int]]:
    """(V block, launch options) of the w/u kernel at value dim V, padded key dim BK: v_block and launch_opts, but
    the forward's launch (`forward`: no qg stored) at K block 128 takes LAUNCH["wu"]'s FWD_BV and register cap
    FWD_MAXNREG (0: none), the launch measured with them (LAUNCH's comment). The backward's recompute (qg too, 245
    registers) keeps the plain launch."""
    bv, opts = v_block("wu", V, BK), launch_opts("wu")
    cap = LAUNCH["wu"]["FWD_MAXNREG"]
    if forward and cap and min(BK, LAUNCH["wu"]["BK"]) == 128:
        bv = max(bv, min(LAUNCH["wu"]["FWD_BV"], triton.next_power_of_2(V)))
        opts = {**opts, "maxnreg": cap}
    return bv, opts


def scan_v_block(bv: int, V: int, seq_heads: int, sms: int) -> int:
    """A state scan's V block: `bv` (from v_block), halved (down to 16) while the halved block still runs fewer
    programs (seq_heads * V / bv, seq_heads = N * HV) than the GPU has multiprocessors (`sms`): each program walks
    its sequence's chunks in order, so with few sequences the V blocks are the only parallelism. H200, per fwd+bwd
    (kda_tune.py): (1, 65536, 16, 128), 32 -> 64 programs at 1 stage: forward scans 6,236 -> 5,443 us, backward
    scan 4,657 -> 3,898 (2026-11-30, session 9); 64 -> 128 programs at 3 stages: forward scans 3,135 -> 2,732,
    backward scan 1,725 -> 1,727; total 15,681 -> 15,286 (session 11). At (2, 16384, 16, 128) V block 16 would make
    256 programs, timed at one stage: forward scans 872 -> 1,581 us (session 11)."""
    while bv > 16 and seq_heads * triton.cdiv(V, bv // 2) < sms:
        bv //= 2
    return bv


def chunk_fwd_states(k, v, beta, Gam, Mm, h0, *, chunk_size, cu_seqlens, h_fp32, cu_host=None, q=None, scale=1.0,
                     kq_dtype=None, Aqk=None, o=None, qg=None, store_states=False, aqk_parts=1):
    """Kernels 3 and 4 from Gamma and M: w, u (`_wu_kernel`), then the state scan with v_new (`_scan_kernel`).
    The forward's tail (chunk_fwd_pipeline) and the backward's only recompute (triton_chunk_bwd.py, from the Gam and
    Mm its forward saved).

    k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV] (any float dtype); Gam: [T_all, HV, K] fp32 (log2 units);
    Mm: [T_all, HV, BT] = (I + L)^-1 per chunk, in the input dtype (the dtype of w, u, v_new); h0: [N, HV, K, V] fp32
    or None. Returns (w [T_all, HV, K], u [T_all, HV, V], vnew [T_all, HV, V] in Mm.dtype, hbuf [NT_all, HV, K, V]
    = state entering each chunk, fp32 if h_fp32 else Mm.dtype, ht [N, HV, K, V] fp32, kg = k e^(Gamma_last - Gamma)
    [T_all, HV, K], qg = scale q e^Gamma [T_all, HV, K] when q [B, T, H, K] is given, else None; kg and qg in
    kq_dtype, default Mm.dtype). cu_host: as chunk_layout.
    With `o` ([B, T, HV, V], to be written), Aqk [T_all, HV, BT] and qg (scale q e^Gamma [T_all, HV, K], the intra
    kernel's) or q: the scan also computes the output o = qg h + Aqk v_new (step 5, `_scan_kernel`'s OUTPUT) and
    stores neither v_new nor the states (vnew and hbuf are returned as None) unless `store_states`. aqk_parts = 2:
    Aqk is [2, T_all, HV, BT], the intra kernel's K halves' partial sums, which the scan adds."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dt = k.device, Mm.dtype
    BT = chunk_size
    BK = max(16, triton.next_power_of_2(K))  # tl.dot needs every dimension >= 16
    k, v, beta = k.to(dt).contiguous(), v.to(dt).contiguous(), beta.contiguous()
    N, NT, NT_all, chunk_indices, chunk_offsets, cu = _layout_args(B, T, BT, cu_seqlens, dev, cu_host, k)
    T_all = B * T
    fused = o is not None
    states = not fused or store_states
    w, u = torch.empty(T_all, HV, K, dtype=dt, device=dev), torch.empty(T_all, HV, V, dtype=dt, device=dev)
    vnew = hbuf = None
    if states:
        vnew = torch.empty(T_all, HV, V, dtype=dt, device=dev)
        hbuf = torch.empty(NT_all, HV, K, V, dtype=torch.float32 if h_fp32 else dt, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    # k e^(Gamma_last - Gamma) (and scale q e^Gamma), from the w/u kernel to the scans
    kg = torch.empty(T_all, HV, K, dtype=kq_dtype or dt, device=dev)
    qg = qg if q is None else torch.empty_like(kg)
    if NT_all == 0 or HV == 0:
        ht.copy_(h0 if h0 is not None else torch.zeros_like(ht))
        return w, u, vnew, hbuf, ht, kg, qg
    varlen, prec = cu_seqlens is not None, fp32_dot_precision() if dt == torch.float32 else "tf32"
    qc = kg if q is None else q.contiguous()  # placeholder pointers without q (STORE_QG off)
    wu_ptrs = (k, v, beta, Gam, Mm, w, u, kg, qc, qg if q is not None else kg)
    wu_bv, wu_opts = wu_launch(V, BK, forward=q is None)
    wu_kw = {"H": H, "HV": HV, "K": K, "V": V, "BK": min(BK, LAUNCH["wu"]["BK"]), "BV": wu_bv, "BT": BT,
             "STORE_QG": q is not None, "PREC": prec, **wu_opts}
    BVs = scan_v_block(v_block("scan", V, BK), V, N * HV, device_sms(dev))
    h0c = h0.contiguous() if h0 is not None else ht
    grid = (triton.cdiv(V, BVs), N, HV)

    def scan_ptrs(h_in, h_out):  # placeholder pointers for the tensors a launch does not touch (OUTPUT, STORE_STATES)
        return (kg, w, u, Gam, vnew if states else w, hbuf if states else w, h_in, h_out, qg if fused else w,
                Aqk if fused else w, o if fused else w)

    scan_kw = {"H": H, "HV": HV, "K": K, "V": V, "BK": BK, "BV": BVs, "BT": BT, "STORE_HT": True, "OUTPUT": fused,
               "STORE_STATES": states, "PREC": prec, "AQK_PARTS": aqk_parts, **scan_opts(states, BK)}
    aqk_stride = T_all * HV * BT  # elements between Aqk's partial sums (aqk_parts = 2)
    P = scan_segments(NT, grid[0] * N * HV, cu_seqlens, dev)
    if not P:
        _wu_kernel[(NT_all, HV)](*wu_ptrs, chunk_indices, cu, float(scale), T, NT, VARLEN=varlen, **wu_kw)
        launch_fitting(_scan_kernel, grid, *scan_ptrs(h0c, ht), cu, chunk_offsets, T, NT, aqk_stride,
                       HAS_H0=h0 is not None, VARLEN=varlen, **scan_kw)
        return w, u, vnew, hbuf, ht, kg, qg
    cu_pad, segs = segment_tables(B, T, BT, P, dev)
    hts = (torch.empty_like(ht), torch.empty_like(ht))  # the state between segments, alternating

    def wu_segment(s):  # the segment's chunks as a varlen chunk list over the padded sequences
        _wu_kernel[(segs[s][3], HV)](*wu_ptrs, segs[s][0], cu_pad, float(scale), T, NT, VARLEN=True, **wu_kw)

    def scan_segment(s):  # from the previous segment's final state; the last one stores ht
        h_in, h_out = h0c if s == 0 else hts[(s - 1) % 2], ht if s == P - 1 else hts[s % 2]
        launch_fitting(_scan_kernel, grid, *scan_ptrs(h_in, h_out), segs[s][1], segs[s][2], T, NT, aqk_stride,
                       HAS_H0=h0 is not None or s > 0, VARLEN=2, **scan_kw)

    run_segments(P, dev, wu_segment, scan_segment, priority=LAUNCH["scan"]["SEGMENT_PRIORITY"])
    return w, u, vnew, hbuf, ht, kg, qg


def scan_segments(NT: int, programs: int, cu_seqlens, dev: torch.device) -> int:
    """The number of time segments P for chunk_fwd_states (triton_segments.py: the w/u kernel of segment s + 1
    overlaps the scan of segment s): NT // LAUNCH["scan"]["SEGMENT_CHUNKS"] when that is at least 2, the layout is
    padded (NT chunks in each sequence) and the scan is chain-bound: fewer scan programs than
    SEGMENT_BELOW x the GPU's multiprocessors (always, off a GPU: the interpreter tests); else 0 (one w/u launch,
    then one scan)."""
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
    two dots too; with few programs that loop is the forward's critical path, which cost more than the stores saved at
    1 stage, but not at 3 (OUTPUT_FROM 0: fused at every shape timed; LAUNCH's comment)."""
    BVs = scan_v_block(v_block("scan", V, max(16, triton.next_power_of_2(K))), V, N * HV, device_sms(dev))
    return N * HV * triton.cdiv(V, BVs) >= LAUNCH["scan"]["OUTPUT_FROM"]


def chunk_fwd_pipeline(q, k, v, g, beta, h0, *, scale, safe_shift, chunk_size, cu_seqlens, h_fp32, store_akk=False,
                       cu_host=None, g_check=None, keep_states=False, l_fp16=False, q_rstd=None):
    """Run the kernels; return a dict of every intermediate (see the module docstring for shapes):
    Gam, Aqk, Mm, w, u, vnew [T_all, HV, *]; hbuf [NT_all, HV, K, V]; o [B, T, HV, V]; ht [N, HV, K, V] fp32
    (vnew and hbuf None when the scan computed o: fuse_output, never with h_fp32);
    with `store_akk` (a training forward: the backward reads it) Akk = k k^T with decay, no beta, fp32
    [T_all, HV, BT], and Lkk None (the solve applies beta to Akk's rows itself); without, Lkk = diag(beta) Akk and
    Akk None. Of either, only the blocks j <= i of each chunk are written. cu_host: cu_seqlens as host ints, or
    None (chunk_layout).
    g_check: (floor, message) or None: the intra kernel also clears a flag (g_ok, int32 [1], returned) where some
    g < floor, and torch._assert_async fails with `message` unless the flag is still set (on a GPU at the next
    synchronisation): the safe gate's bound check without a pass of its own over g (a g.amin() took 69 us at
    (8, 4096, 16, 128) on the H200).
    keep_states (a training forward for the Triton backward): "states" = (w, vnew, hbuf, kg, qg), what the backward
    would otherwise recompute, when the scan computes the output and can store them in the dtypes the backward reads
    (triton_chunk_bwd.recompute_dtypes); else "states" is None (the backward recomputes them).
    l_fp16: L stored in fp16 rather than fp32 (without store_akk; the forward decides: l_in_fp16); with it and
    LAUNCH["intra"]["KSPLIT_FROM"] <= BK, "Lkk" and "Aqk" hold the K halves' two partial sums [2, T_all, HV, BT]
    (fp16). q_rstd: q is raw, its rows' L2 norms' inverses q_rstd [B T H] fp32 (l2norm_fwd without y; an inference
    forward, LAUNCH["intra"]["Q_RSTD"]): the intra kernel scales q's rows, or (the output kernel's path, which reads
    q itself) q is normalised here first."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dt = q.device, q.dtype
    BT, BC = chunk_size, SUB_CHUNK
    NC = BT // BC
    BK = max(16, triton.next_power_of_2(K))  # tl.dot needs every dimension >= 16
    q, k, v, g, beta = q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous(), g.contiguous(), beta.contiguous()
    N, NT, NT_all, chunk_indices, _, cu = _layout_args(B, T, BT, cu_seqlens, dev, cu_host, q)
    T_all = B * T
    f32 = torch.float32
    # the intra kernel's K split (an inference forward with fp16 L, LAUNCH["intra"]["KSPLIT_FROM"]): two programs per
    # sub-chunk, one per K half, whose partial sums (fp16: |.| <= 1 with the L2 norm) the solve adds (L) and the
    # output's reader adds (Aqk)
    split = l_fp16 and not store_akk and 0 < LAUNCH["intra"]["KSPLIT_FROM"] <= BK and BK >= 32  # halves >= 16 (dots)
    parts = 2 if split else 1
    r = {"Gam": torch.empty(T_all, HV, K, dtype=f32, device=dev),
         "Aqk": torch.empty(*((2,) if split else ()), T_all, HV, BT, dtype=torch.float16 if split else dt,
                            device=dev),  # [2, ...] fp16 partial sums with split
         "Lkk": torch.empty(*((2,) if split else ()), T_all, HV, BT,
                            dtype=torch.float16 if l_fp16 and not store_akk else f32,
                            device=dev),  # L, or Akk with store_akk (one buffer); [2, ...] partial sums with split
         "Mm": torch.empty(T_all, HV, BT, dtype=dt, device=dev),
         "o": torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)}
    launch = NT_all > 0 and HV > 0
    common = {"VARLEN": cu_seqlens is not None, "PREC": fp32_dot_precision() if dt == torch.float32 else "tf32"}
    Gam, Aqk, Lkk, Mm = r["Gam"], r["Aqk"], r["Lkk"], r["Mm"]
    r["Akk"], r["Lkk"] = (Lkk, None) if store_akk else (None, Lkk)
    # the output fused into the scan, unless the caller wants the states (h_fp32: return_intermediate_states)
    fused = launch and not h_fp32 and fuse_output(N, HV, V, K, dev)
    # qg = scale q exp2(Gamma) for the fused output, stored by the intra kernel, which holds q and Gamma anyway:
    # H200, us per fwd+bwd (kda_tune.py, 2026-11-30, RESULTS.md session 10): intra +33, w/u -66 (which loaded q to
    # store it), total 6,297 -> 6,258 at (8, 4096, 16, 128); 6,532 -> 6,467 at (16, 2048, 32, 64)
    qg = torch.empty(T_all, HV, K, dtype=dt, device=dev) if fused else None
    if q_rstd is not None and not fused:  # as l2norm_fwd's y: x r in fp32, stored in q's dtype
        q, q_rstd = (q.float() * q_rstd.view(*q.shape[:-1], 1)).to(dt), None
    if keep_states and fused:
        from .triton_chunk_bwd import recompute_dtypes  # here: that module imports this one

        keep_states = recompute_dtypes(dt) == (dt, dt)  # hbuf (and kg, qg) stored in dt by the fused forward
    else:
        keep_states = False
    if launch:
        shift = 0.0 if safe_shift is None else safe_shift * RCP_LN2
        intra = {"H": H, "HV": HV, "K": K, "BK": BK, "BT": BT, "BC": BC, "NC": NC, "SAFE": safe_shift is not None,
                 "STORE_AKK": store_akk, "CHECK_G": g_check is not None, "STORE_QG": qg is not None,
                 "Q_RSTD": q_rstd is not None, **common}
        g_ok = r["g_ok"] = torch.ones(1, dtype=torch.int32, device=dev) if g_check else Lkk
        part_stride = T_all * HV * BT  # elements between the K halves' partial sums
        intra.update(BK=BK // parts, KSPLIT=parts)
        _intra_sub_kernel[(NT_all * NC * parts, HV)](q, k, g, beta, Gam, Aqk, Lkk, g_ok,
                                                     qg if qg is not None else Lkk,
                                                     q_rstd if q_rstd is not None else Lkk, chunk_indices, cu,
                                                     float(scale), shift, float(g_check[0]) if g_check else 0.0,
                                                     T, NT, part_stride, **intra, **intra_opts(BK // parts))
        if g_check:
            torch._assert_async(g_ok, g_check[1])
        _solve_kernel[(NT_all, HV)](Lkk, beta, Mm, chunk_indices, cu, T, NT, part_stride, HV=HV,
                                    BT=BT, BC=BC, NC=NC, BETA=store_akk, PARTS=parts, **common,
                                    **solve_opts(store_akk))
    r["w"], r["u"], r["vnew"], r["hbuf"], r["ht"], kg, _ = chunk_fwd_states(
        k, v, beta, Gam, Mm, h0, chunk_size=BT, cu_seqlens=cu_seqlens, h_fp32=h_fp32, cu_host=cu_host,
        scale=scale, Aqk=Aqk if fused else None, o=r["o"] if fused else None, qg=qg, store_states=keep_states,
        aqk_parts=parts)
    r["states"] = (r["w"], r["vnew"], r["hbuf"], kg, qg) if keep_states else None  # not u: the backward reads v_new
    if launch and not fused:
        BVo = v_block("output", V, BK)
        _output_kernel[(triton.cdiv(V, BVo), NT_all, HV)](q, Gam, Aqk, r["vnew"], r["hbuf"], r["o"], chunk_indices,
                                                          cu, float(scale), T, NT, part_stride, H=H, HV=HV, K=K,
                                                          V=V, BK=BK, BV=BVo, BT=BT, AQK_PARTS=parts, **common,
                                                          **launch_opts("output"))
    return r


class _ChunkKDATriton(torch.autograd.Function):
    """Triton forward; backward chosen by K3_KDA_BWD (Triton by default, or the PyTorch recompute), read when the
    forward runs with gradients needed (cfg["grad"]: grad mode at the call, and some input requires grad).

    q, k: [B, T, H, K] (unscaled; normalized, or raw with cfg["l2norm"]: the Function then normalizes them and keeps
    the normalized ones and their rstd [B T H] fp32 for the backward); v: [B, T, HV, V];
    g: [B, T, HV, K] fp32; beta: [B, T, HV]; h0: [N, HV, K, V] fp32 or None.
    Returns o [B, T, HV, V], final state [N, HV, K, V] fp32, h [NT_all, HV, K, V] (no gradient; None when the
    scan computed o, which it never does for return_intermediate_states).

    Kept for the backward (ctx.bwd):
      None (inference): nothing, and the intra kernel stores no Akk.
      "triton": q, k, v, beta, h0 and the forward's Gam fp32 [T_all, HV, K], Aqk [T_all, HV, BT] (input dtype),
        Akk fp32 [T_all, HV, BT], Mm [T_all, HV, BT] (input dtype); not g. Per token and value head that is Gam 4K
        bytes + Aqk 2 BT + Akk 4 BT + Mm 2 BT (bf16; those three 512 bytes at BT = 64) in place of g's 4K, and no
        intra or solve kernel in the backward. By default (keep_states()) also the forward's w, v_new, the states
        entering each chunk, kg and qg (chunk_fwd_pipeline's "states"; bf16 for bf16 inputs: 2 (3K + V + KV / BT)
        bytes, 1,536 at K = V = 128, BT = 64), so the backward recomputes nothing; with K3_KDA_RECOMPUTE=1 the
        backward recomputes those (chunk_fwd_states), the policy of fla-core 0.6.0's `ChunkKDAFunction`
        (fla.ops.kda.chunk), which saves the gate cumsum, Aqk and Akk and recomputes w, u and h.
      "torch": q, k, v, g, beta, h0 (the PyTorch backward recomputes everything from them)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cfg):
        ctx.bwd = backward_impl() if cfg["grad"] and any(ctx.needs_input_grad[:6]) else None
        ctx.cfg = cfg
        norm, q_rstd = (), None
        if cfg["l2norm"]:  # q, k <- their L2 norms; the backward runs the norm's own (in the intra kernel if it can)
            if ctx.bwd is None and LAUNCH["intra"]["Q_RSTD"]:  # inference: q's rows scaled by the intra kernel
                (_, q_rstd), (k, rk) = l2norm_fwd(q, store_y=False), l2norm_fwd(k)
            else:
                (q, rq), (k, rk) = l2norm_fwd(q), l2norm_fwd(k)
                norm = (rq, rk)
        # no zero-filled gradients for unused outputs: autograd would write one for hbuf ([NT_all, HV, K, V], never
        # differentiable) on every backward, 81 us at (8, 4096, 16, 128) on the H200 (Nsight Compute, 2026-11-30)
        ctx.set_materialize_grads(False)
        r = chunk_fwd_pipeline(q, k, v, g, beta, h0, scale=cfg["scale"], safe_shift=cfg["safe_shift"],
                               chunk_size=cfg["chunk_size"], cu_seqlens=cfg["cu_seqlens"], h_fp32=cfg["h_fp32"],
                               store_akk=ctx.bwd == "triton", cu_host=cfg["cu_host"], g_check=cfg["g_check"],
                               keep_states=ctx.bwd == "triton" and keep_states(),
                               l_fp16=l_in_fp16(cfg["l2norm"], q.dtype), q_rstd=q_rstd)
        if ctx.bwd == "triton":
            from .triton_chunk_bwd import q_norm_from_output  # here: that module imports this one

            # the output too where the backward's intra kernel takes q's norm backward from it
            ctx.o_saved = bool(norm) and q_norm_from_output(q.shape[2], v.shape[2], q.shape[3])
            ctx.save_for_backward(q, k, v, beta, h0, r["Gam"], r["Aqk"], r["Akk"], r["Mm"], *norm,
                                  *((r["o"],) if ctx.o_saved else ()), *(r["states"] or ()))
            ctx.g_dtype = g.dtype
        elif ctx.bwd == "torch":
            ctx.save_for_backward(q, k, v, g, beta, h0, *norm)
        ctx.o_meta = (r["o"].shape, r["o"].dtype, r["o"].device)  # for a zero do when only the state is used
        if r["hbuf"] is not None:  # None when the scan computed the output (triton_chunk.fuse_output)
            ctx.mark_non_differentiable(r["hbuf"])
        return r["o"], r["ht"], r["hbuf"]

    @staticmethod
    def backward(ctx, do, dht, _dh):
        cfg = ctx.cfg
        if do is None:  # only the final state was used: o's gradient is zero
            shape, dtype, device = ctx.o_meta
            do = torch.zeros(shape, dtype=dtype, device=device)
        if ctx.bwd == "triton":
            from .triton_chunk_bwd import chunk_bwd_triton  # imported here: that module imports this one

            q, k, v, beta, h0, Gam, Aqk, Akk, Mm, *rest = ctx.saved_tensors
            norm, rest = (rest[:2], rest[2:]) if cfg["l2norm"] else (None, rest)
            o, states = (rest[0], rest[1:]) if ctx.o_saved else (None, rest)
            grads = chunk_bwd_triton(q, k, v, beta, h0, Gam, Aqk, Akk, Mm, do, dht, scale=cfg["scale"],
                                     safe_shift=cfg["safe_shift"], chunk_size=cfg["chunk_size"],
                                     cu_seqlens=cfg["cu_seqlens"], cu_host=cfg["cu_host"], states=states or None,
                                     rstd=norm, o=o)
            dtypes = (q.dtype, k.dtype, v.dtype, ctx.g_dtype, beta.dtype, None)
            out = [d.to(t) if d is not None and t is not None else d for d, t in zip(grads, dtypes, strict=True)]
            return (*out, None)
        q, k, v, g, beta, h0, *norm = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, g, beta, h0)]
            o, ht = chunk_kda_torch(*leaves[:5], scale=cfg["scale"], initial_state=leaves[5], output_final_state=True,
                                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                                    dt_bias=None, use_beta_sigmoid_in_kernel=False, safe_gate=cfg["safe_shift"]
                                    is not None, lower_bound=cfg["lower_bound"], chunk_size=cfg["chunk_size"],
                                    cu_seqlens=cfg["cu_seqlens"], return_intermediate_states=False,
                                    state_v_first=False, cu_seqlens_cpu=cfg["cu_host"])
            live = [x for x in leaves if x is not None]
            outs = [(y, dy) for y, dy in ((o, do), (ht, dht)) if dy is not None]  # dht None: the state was unused
            grads = iter(torch.autograd.grad([y for y, _ in outs], live, [dy for _, dy in outs], allow_unused=True))
        out = [next(grads) if x is not None else None for x in leaves]
        if norm:  # gradients of the normalised q, k -> of the raw ones
            out[:2] = [None if d is None else l2norm_bwd_from_y(y, r, d) for y, r, d in zip((q, k), norm, out[:2])]
        return (*out, None)


def backward_impl() -> str:
    """Which backward `_ChunkKDATriton` runs, read by its forward (which keeps what that backward needs):
    K3_KDA_BWD=triton (default: triton_chunk_bwd.py, which passes the interpreter tests on the CPU and the fp32/bf16
    suite on an H200) or K3_KDA_BWD=torch (recompute with the PyTorch path and return its gradients; slower, kept as a
    cross-check)."""
    name = os.environ.get("K3_KDA_BWD", "triton").strip().lower() or "triton"
    if name not in ("triton", "torch"):
        raise ValueError(f"K3_KDA_BWD must be 'triton' or 'torch', got {name!r}; unset it for the default backward")
    return name


def keep_states() -> bool:
    """Whether a training forward keeps w, v_new, the states, kg and qg for the Triton backward (the default), or
    the backward recomputes them from Gamma and M (K3_KDA_RECOMPUTE=1: 1,536 bytes less per token and value head at
    K = V = 128 in bf16, 1.9 GB per layer at (1, 65536, 16, 128), for one w/u kernel and one state scan more per
    backward). Read by the forward, like K3_KDA_BWD."""
    raw = os.environ.get("K3_KDA_RECOMPUTE", "0").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return True
    if raw in ("1", "true", "yes", "on"):
        return False
    raise ValueError(f"K3_KDA_RECOMPUTE must be 0 (keep the forward's states for the backward, the default) or 1 "
                     f"(recompute them in the backward, less memory), got {raw!r}")


def chunk_kda_triton(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, safe_gate, lower_bound,
                     chunk_size, cu_seqlens, return_intermediate_states, state_v_first, cu_seqlens_cpu=None):
    """Triton implementation behind `chunk_kda` (arguments validated by the public function; see chunk_kda).

    Same inputs and returns as `chunk_kda_torch`: (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or
    None[, h [B, NT, HV, K, V] fp32]). Forward by the Triton kernels above; backward by triton_chunk_bwd.py
    (or, with K3_KDA_BWD=torch, by the PyTorch path).
    """
    kwargs = {"scale": scale, "initial_state": initial_state, "output_final_state": output_final_state,
              "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_gate_in_kernel": use_gate_in_kernel,
              "A_log": A_log, "dt_bias": dt_bias, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
              "safe_gate": safe_gate,
              "lower_bound": lower_bound, "chunk_size": chunk_size, "cu_seqlens": cu_seqlens,
              "return_intermediate_states": return_intermediate_states, "state_v_first": state_v_first,
              "cu_seqlens_cpu": cu_seqlens_cpu}
    if q.dtype == torch.float64:  # the reference precision stays on the PyTorch implementation
        return chunk_kda_torch(q, k, v, g, beta, **kwargs)
    check_device("chunk_kda", q, k, v, g, beta, initial_state)
    B, _T, _, K = q.shape
    HV = v.shape[2]
    # in-kernel steps before the core: q/k L2 norm inside _ChunkKDATriton (one Triton pass each, fp32 inside, stored
    # in their dtype; its backward fused into the backward intra kernel where it can be); the gate as one Triton
    # pass (fp32 out, autograd-capable); the beta sigmoid as a PyTorch op; g fp32. beta as given (the kernels load
    # it in fp32; its gradient comes back in its dtype): a bf16 beta's cast to fp32 and its gradient's cast back were
    # two ~3-5 us launches of each fwd+bwd
    if use_gate_in_kernel:  # one Triton pass each way (triton_gate.py; twins: gate.py)
        g = kda_gate_triton(g, A_log, dt_bias, lower_bound)
    g = g.float()
    beta = torch.sigmoid(beta.float()) if use_beta_sigmoid_in_kernel else beta
    safe_shift = g_check = None
    if safe_gate:
        floor = SAFE_GATE_FLOOR if lower_bound is None else lower_bound
        if not use_gate_in_kernel and g.numel():
            msg = (f"chunk_kda: safe_gate=True needs every g >= {floor} (lower_bound); clamp g to [lower_bound, 0] "
                   f"or pass safe_gate=False")
            if g.is_cuda:  # checked by the intra kernel, no host sync (a violation fails at the next synchronisation)
                g_check = (floor, msg)
            elif g.min().item() < floor:
                raise ValueError(f"{msg}; got min(g)={g.min().item():.4g}")
        s = -lower_bound if lower_bound is not None else 2.0
        safe_shift = (SUB_CHUNK - 1) * s / 2  # C = Gamma_0 - (BC - 1) s / 2 (kda.md 3.3), in nats
    h0 = None
    if initial_state is not None:
        h0 = initial_state.float()
        h0 = h0.transpose(-1, -2) if state_v_first else h0
    cfg = {"scale": K**-0.5 if scale is None else scale, "safe_shift": safe_shift, "chunk_size": chunk_size,
           "cu_seqlens": cu_seqlens, "h_fp32": return_intermediate_states, "lower_bound": lower_bound,
           "cu_host": cu_seqlens_cpu, "g_check": g_check, "l2norm": use_qk_l2norm_in_kernel,
           "grad": torch.is_grad_enabled()}  # read here: the Function's forward runs without grad mode
    o, ht, hbuf = _ChunkKDATriton.apply(q, k, v, g, beta, h0, cfg)
    final = None
    if output_final_state:
        final = ht.transpose(-1, -2).contiguous() if state_v_first else ht
    if not return_intermediate_states:
        return o, final
    h = hbuf.view(B, -1, HV, K, v.shape[3]) if cu_seqlens is None else hbuf.unsqueeze(0)
    h = h.transpose(-1, -2).contiguous() if state_v_first else h
    return o, final, h
