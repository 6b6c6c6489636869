"""Chunkwise KDA backward as Triton kernels (the backward of `chunk_kda` on the "triton" backend).

Legend as in triton_chunk.py: T_all total tokens, H q/k heads, HV value heads, K key dim, V value dim, BT chunk size,
BC = 16 sub-chunk, NC = BT / BC, NT_all chunks over all sequences, BK = next_pow2(K), BV value block.
Gamma = chunk-local cumsum(g) (stored in log2 units, so exp(Gamma) = exp2(Gam)); qs = scale * q.

Forward per chunk (kda.md 3.1): Aqk = tril(qs k^T decay), L = diag(beta) Akk (strict), M = (I + L)^-1,
w = M diag(beta) (k e^Gamma), u = M diag(beta) v, v_new = u - w h, o = (qs e^Gamma) h + Aqk v_new,
h' = Diag(e^Gamma_last) h + (k e^(Gamma_last - Gamma))^T v_new.  The backward is the chain rule of these lines
(the same derivation as chunk.py `_ChunkKDA.backward`, at chunk granularity):
  reverse scan (dh' = gradient of the state leaving chunk c, starting from d final state):
    dv_new = Aqk^T do + kg dh'                                  kg = k e^(Gamma_last - Gamma)
    dh     = Diag(e^Gamma_last) dh' + qg^T do - w^T dv_new      qg = qs e^Gamma        (dh of chunk 0 = dh0)
  per chunk:  dqg = do h^T,  dAqk = tril(do v_new^T),  dkg = v_new dh'^T,  dw = -dv_new h^T,  du = dv_new
    [dkb | dvb] = M^T [dw | du]  (kb = beta k e^Gamma, vb = beta v; dkb = -dvb h^T, one dot fewer),
    dL = -strict(dkb w^T + dvb u^T) = -strict(dvb v_new^T)    (dkb w^T = -dvb (w h)^T and v_new = u - w h)
    dv = beta dvb,  dbeta = rowsum(dL * Akk) + rowsum(dkb * k e^Gamma) + rowsum(dvb * v),  dAkk = diag(beta) dL
    dGamma gets qg * dqg + beta k e^Gamma * dkb - kg * dkg, and row Gamma_last gets sum_t kg*dkg + e^Gamma_last
    * rowsum(dh' * h);  then the intra-chunk terms of Aqk and Akk (dq, dk and dGamma from exp(Gamma_i - Gamma_j))
    with the forward's anchors (kda.md 3.3), and finally dg = reverse cumsum of dGamma inside the chunk.

Kernels:
1. `_bwd_scan_kernel`, one program per (V block, sequence, value head): the reverse scan; stores dv_new, dh' per
   chunk (fp32, or bf16 for bf16 inputs with bf16 dots) and dh0. For K > 128 it holds the state gradient in two K
   halves (SPLIT).
2. `_bwd_inter_kernel`, one program per (chunk, value head): everything above except the intra-chunk terms; stores
   dv, dbeta and partial dqs, dk, dGamma (fp32; dqs and dk in the inputs' dtype with LAUNCH["bwd_inter"]
   ["HALF_PARTIALS"]), plus dAqk and dAkk (fp32 [T_all, HV, BT]).
3. `_bwd_intra_kernel` (triton_intra_bwd.py, as 4), one program per (chunk, 16-token sub-chunk, K block, value
   head): the gradient of Aqk and Akk w.r.t. q, k, Gamma of the sub-chunk's rows: as queries against earlier
   sub-chunks' keys (anchor Gamma_n, the sub-chunk's first row) and as keys against later sub-chunks' queries
   (anchor: its last row), both factors <= 1; the diagonal block with the fixed anchor C (safe gate) or exact
   pairwise exponents. Stores dq, dk, dGamma (with the q / k L2 norm's backward inside where it can be).
4. `_bwd_dg_kernel`, one program per (chunk, K block, value head): dg = reverse cumsum of dGamma inside the chunk.
Inputs from the forward: a training forward (triton_chunk._ChunkKDATriton) saves Gamma (fp32), Aqk, Akk (fp32) and M;
only w, u, v_new and the states (stored fp32, or bf16 for bf16 inputs) are recomputed from them
(triton_chunk.chunk_fwd_states), so the backward runs no intra-chunk or solve kernel. Per token and value head the
saved Gam 4K + Aqk 2 BT + Akk 4 BT + M 2 BT bytes (bf16) replace g's 4K: fla-core 0.6.0's policy too
(`ChunkKDAFunction` saves the gate cumsum, Aqk and Akk).
All backward arithmetic is fp32; the dots of fp32 inputs run tf32x3 (near fp32 on the tensor cores;
K3_KDA_FP32_DOTS=ieee or tf32 picks another, triton_common.fp32_dot_precision). For bf16/fp16 inputs the intra kernel's
diagonal (anchored) blocks run 'bf16x3' (three bf16 MMAs, near-fp32 accuracy), as kda.md 3.3 prescribes for the
safe-path backward (HALF_INPUT_PRECISION); every other dot, whose factors are all <= 1, takes LAUNCH[...]["PREC"]:
bf16 in the scan and inter kernels, tf32 in the intra kernel's off-diagonal blocks (fla-core 0.6.0's choices).
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from ..dispatch import triton_interpreter
from .chunk import SUB_CHUNK
from .triton_chunk import LAUNCH as FWD_LAUNCH
from .triton_chunk import RCP_LN2, chunk_fwd_states, device_sms, entry_opts, register_cap, scan_v_block
from .triton_common import (
    _chunk_bounds,
    _dot,
    _f32,
    _load_lower_blocks,
    _load_tril,
    _seq_bounds,
    chunk_layout,
    fp32_dot_precision,
    launch_fitting,
)
from .triton_intra_bwd import _bwd_dg_kernel, _bwd_intra_kernel
from .triton_l2norm import l2norm_bwd_from_y

# Launch settings per backward kernel (as triton_chunk.LAUNCH; swept by benchmarks/kda_tune.py, RESULTS.md
# session 7: H200, (8, 4096, 16, 128) bf16, us per fwd+bwd).
# PREC: the dot precision for bf16/fp16 inputs of the scan and inter kernels, and of the intra kernel's off-diagonal
# blocks: every factor there is <= 1 (no anchored exponents; the intra kernel's diagonal blocks keep bf16x3, kda.md
# 3.3). "bf16" (operands rounded to bf16, one MMA: fla-core 0.6.0's choice for these kernels), "tf32" or "bf16x3"
# (three MMAs, near fp32). Measured: scan 786 / 1,218 / 1,768 us and inter 1,844 / 2,525 / 3,742 us in bf16 / tf32 /
# bf16x3 at 8 warps; the intra kernel's off-diagonal blocks 3,096 us in tf32 against 3,273 in bf16x3 at 4 warps
# (fla runs those in tf32 too). The gradients meet kda.md's bf16 thresholds in every setting (GPU tests).
LAUNCH: dict[str, dict[str, int]] = {
    # bwd_scan: 404 us per fwd+bwd at 4 warps, 615 at 8 (session 8, kg / qg loaded, bf16 operands; 8 won before)
    # The state gradient in two [64, BV] K halves (as fla's dhu kernel holds it) took 416 us against 414 (H200,
    # 2026-11-30, RESULTS.md session 10) at 218 against 255 registers: not at K <= 128. Above 128 the kernel holds
    # two halves of next_pow2(K) / 2 (SPLIT: one piece did not fit the H200's shared memory in fp32, session 13)
    # 3 stages, as the forward scans (times at 1 / 2 / 3 stages in triton_chunk.LAUNCH's comment)
    # BV 128 with WIDE_WARPS / WIDE_STAGES (bwd_scan_launch), where the halving below (triton_chunk.scan_v_block)
    # leaves it: one program per sequence and head, 8 warps (4 spill 596 bytes a thread; ptxas sm_90a) and 2 stages
    # (208 KB of shared memory; 3 do not fit). At (8, 4096, 16, 128) the V block 64's 256 programs, one per
    # multiprocessor (208 KB each), ran in two waves on the H200's 132: fwd+bwd 5.120 -> 5.045 ms (kda.py, 2026-11-30,
    # RESULTS.md session 17, call 4). The forward scan the same way lost (fwd 1.498 -> 1.549 ms)
    # SMALL_K_STAGES: num_stages at K <= 64 (V block 64: 136 KB at 3 stages, one program per multiprocessor; 96 KB
    # at 2, two). At (16, 2048, 32, 64), fwd+bwd 4.611 ms at 3 / 3 stages (this scan / the forward's), 4.584 at 2 / 3,
    # 4.596 at 3 / 2, 4.568 at 2 / 2 (kda.py, 2026-11-30, RESULTS.md session 17, call 5)
    "bwd_scan": {"num_warps": 4, "num_stages": 3, "BV": 128, "PREC": "bf16", "WIDE_WARPS": 8, "WIDE_STAGES": 2,
                 "SMALL_K_STAGES": 2, "maxnreg": 0},
    # BK: the K block of the inter kernel's outer loop (>= next_pow2(K): one pass). 64 halves the per-key
    # accumulators at K = 128: 1,844 us against 2,398-2,444 in one pass (bf16, 8 warps)
    # HALF_PARTIALS: its partial dq and dk (dqs, dkk [T_all, HV, K], read back by the intra kernel) stored in the
    # inputs' bf16 / fp16 instead of fp32 (partial_dtype): 268 MB less written and read back of the three fp32
    # partials' 805 MB at (8, 4096, 16, 128); dGamma stays fp32 (its in-chunk cumsum sums 64 rows). H200, us per
    # fwd+bwd, inter + intra kernel, fp32 / bf16 partials (kda_tune.py --defaults, 2026-11-30, RESULTS.md session
    # 12): (8, 4096, 16, 128) 1,716 + 1,494 / 1,654 + 1,468, total 6,139 / 6,053; (16, 2048, 32, 64) 1,933 + 1,542 /
    # 1,825 + 1,506, total 6,104 / 5,957; the GPU's bf16 gradient tests pass with them
    # dL = -dvb v_new^T in place of -(dvb u^T + dkb w^T) (session 15): H200, us, kda_tune.py --defaults: 1,825 ->
    # 1,423 at (16, 2048, 32, 64), ~1,650 -> 1,448 at (8, 4096, 16, 128). A one-pass form for K, V <= 64 (no loops;
    # each tile dead after its use; 253 registers at 8 warps) took 1,656 us there, 1,571 capped at 128 registers
    # (396 B spilled), 1,655 at 4 warps: removed (RESULTS.md session 15)
    # EARLY_LOADS: 0, 1 or 2, the kernel's EARLY (loads issued sooner). H200, us, kda_tune.py (RESULTS.md session 16,
    # call 2), 0 / 1 / 2: 1,366 / 1,411 / 1,342 at (8, 4096, 16, 128); 1,357 / 1,348 / 1,196 at (16, 2048, 32, 64)
    "bwd_inter": {"num_warps": 8, "num_stages": 1, "BV": 64, "BK": 64, "PREC": "bf16", "HALF_PARTIALS": True,
                  "EARLY_LOADS": 2, "maxnreg": 0},
    # BK: the intra kernel's K block, one program per (chunk, sub-chunk, K block, head): 1,502 us at 1 warp / 1
    # stage (session 8; 2 warps: 1,617 at 2 stages, 1,855 at 1; 2,083 at 4 warps, 4,029 at 8; K block 16 at 4
    # warps: 5,151); one program per (chunk, K block, head) before: 2,983 us at best
    # One program per (chunk, K block, head) walking the sub-chunks and storing dg directly (no dg pass) took 1,820
    # us against 1,494 + 146 for this kernel and the dg pass (H200, 2026-11-30, RESULTS.md session 10): removed.
    # K block 64 (session 12, kda_tune.py --defaults): 2,861 us against 1,511 at (16, 2048, 32, 64), 2,514 against
    # 1,468 at (8, 4096, 16, 128)
    # Session 13 gave K <= 64 a launch of its own: at (16, 2048, 32, 64) K block 64 at 2 warps / 2 stages took 1,460
    # us against 1,495 at the K block 32, 1 warp launch (1 stage: 1,617); at (8, 4096, 16, 128) K block 64 at 2 warps
    # / 1 stage 1,567 against 1,447, K block 128 at 4 warps 1,657 (H200, kda_tune.py --set, 2026-11-30, RESULTS.md
    # session 13). Session 15: 3 stages, 1,349 us against 1,493 at 1 and ~1,390 at 2 at (16, 2048, 32, 64); and the
    # same launch at K = 128, 1,319 us against 1,362 for K block 32 at 1 warp / 1 stage at (8, 4096, 16, 128) (2
    # stages: 1,326), so one launch for every K again (RESULTS.md session 15, calls 1, 2, 8; those times with the
    # diagonal dots in bf16, see 0a3c5a9)
    # With the head in K blocks (K > BK), the q / k L2 norm's backward runs as a pass of its own (l2norm_bwd_from_y):
    # one program walking the K blocks, storing dy, then dx = r (dy - y sum(dy y)) after a barrier, took 2,221 us
    # (4 warps; 2,038 at 2) against 1,434 + 190 at (8, 4096, 16, 128) (RESULTS.md session 16, call 4): removed
    # PREC "bf16" for the off-diagonal dots: fwd+bwd 5.120 -> 5.036 ms at (8, 4096, 16, 128), 4.647 -> 4.573 at (16,
    # 2048, 32, 64) (kda.py, session 16, calls 5-6), and the bf16 GPU tests pass with it; but the gate gradient's
    # error grows 1.7x (dg 3.3e-3 -> 5.7e-3 relative RMS against float64, fp32 inputs with those operands rounded,
    # CPU): tf32 kept, fla-core 0.6.0's precision there. On the H200 (bf16 inputs against float64, kda_grad_error.py,
    # RESULTS.md session 17, call 1) dg's error grows 3.27e-3 -> 4.36e-3 at (1, 4096, 16, 128), 3.29e-3 -> 4.36e-3 at
    # (1, 2048, 32, 64), against fla's 3.31e-3 / 3.37e-3: less accurate than fla, so not shipped
    # CHAIN_DG (session 16: no dg pass; the inter kernel reverse-cumsummed its dGamma part, the intra programs chained
    # their parts' column sums behind ready flags) lost: inter 1,342 -> 1,636 us, intra 1,434 -> 1,818 against the
    # 135 us pass at (8, 4096, 16, 128); 1,196 -> 1,351 and 1,530 -> 1,963 at (16, 2048, 32, 64); fwd+bwd 5.58 / 5.05
    # ms against 5.12 / 4.65 (session 17, call 2): removed
    # Q_NORM_OUT: where the norm's backward cannot run in this kernel (K > its K block), q's runs in it all the same
    # (its row sums from the output and its gradient, loaded here: _bwd_intra_rows), and only k's keeps the pass of
    # its own (l2norm_bwd_from_y), which at (8, 4096, 16, 128) takes ~190 us for both. H200, us per fwd+bwd there
    # (kda_tune.py --defaults, 2026-11-30, RESULTS.md session 18, call 2), off / on: this kernel 1,429 / 1,504, torch
    # ops 327 / 233, total 4,972 / 4,947; dq's error against float64 3.64e-3 / 3.24e-3 (fla-core 0.6.0: 3.24e-3).
    # ptxas (sm_90a, K = 128): 255 registers either way, spills 24 -> 32 bytes a thread. The row sums taken by the
    # inter kernel with its do tiles instead (call 3) spilled there (124 -> 176 bytes) and lost: inter 1,349 -> 1,516
    # us, this kernel 1,510 -> 1,464, total 4,969 -> 5,092: removed
    "bwd_intra": {"num_warps": 2, "num_stages": 3, "BK": 64, "PREC": "tf32", "Q_NORM_OUT": True, "maxnreg": 0},
    # the dg pass (in-chunk reverse cumsum of dGamma), one program per (chunk, K block of BK, head): 134 / 136 us at
    # K block 64 against 146 / 149 at 32 at the two shapes above (the same calls)
    "bwd_dg": {"num_warps": 4, "BK": 64, "maxnreg": 0},
}


def set_launch_entry(item: str) -> tuple[dict, str, object]:
    """Apply one "NAME.KEY=VALUE" to the chunk kernels' launch settings (NAME a key of triton_chunk.LAUNCH or of this
    module's LAUNCH; VALUE an int, True / False, or a string such as a dot precision) and return (that entry's dict,
    KEY, the value it replaced), so a caller can restore it. benchmarks/kda_tune.py --set and the tests'
    K3_TEST_KDA_LAUNCH take this form. ValueError names the known NAME.KEY pairs."""
    m = re.fullmatch(r"(\w+)\.(\w+)=(\S+)", item.strip())
    tables = [t[m[1]] for t in (FWD_LAUNCH, LAUNCH) if m and m[1] in t]
    if not tables or m[2] not in tables[0]:
        known = sorted(f"{n}.{k}" for t in (FWD_LAUNCH, LAUNCH) for n, e in t.items() for k in e)
        raise ValueError(f"{item!r}: expected NAME.KEY=VALUE with NAME.KEY one of {known}")
    raw, table = m[3], tables[0]
    old = table[m[2]]
    table[m[2]] = {"True": True, "False": False}.get(raw, int(raw) if raw.lstrip("-").isdigit() else raw)
    return table, m[2], old


def _opts(name: str) -> dict[str, int]:
    return entry_opts(LAUNCH[name])


def q_norm_from_output(H: int, HV: int, K: int) -> bool:
    """Whether the backward intra kernel takes q's L2-norm backward from the forward's output (Q_NORM_OUT): on, with
    q / k heads not shared, where its K block does not hold a head (else the whole norm runs there, NORM)."""
    BK = max(16, triton.next_power_of_2(K))
    return bool(LAUNCH["bwd_intra"]["Q_NORM_OUT"]) and H == HV and intra_launch(BK)[0] < K


def intra_launch(BK: int) -> tuple[int, dict[str, int]]:
    """(K block, num_warps / num_stages) of the backward intra kernel at padded key dim BK: LAUNCH["bwd_intra"]'s K
    block (at most BK, at least 16)."""
    return max(16, min(BK, LAUNCH["bwd_intra"]["BK"])), _opts("bwd_intra")


def bwd_scan_launch(V: int, BK: int, seq_heads: int, sms: int) -> tuple[int, dict[str, int]]:
    """(V block, num_warps / num_stages) of the reverse state scan at padded key dim BK over seq_heads = N * HV
    sequence-heads on `sms` multiprocessors: LAUNCH["bwd_scan"]["BV"] (64 at most when BK > 128: the kernel then holds
    two K halves), halved while the halved block still runs fewer programs than multiprocessors (scan_v_block); a
    block of 128 or more runs WIDE_WARPS / WIDE_STAGES, BK <= 64 SMALL_K_STAGES."""
    bv = _bv("bwd_scan", V)
    bv = scan_v_block(min(bv, 64) if BK > 128 else bv, V, seq_heads, sms)
    opts = _opts("bwd_scan")
    if bv >= 128:
        opts = register_cap(LAUNCH["bwd_scan"], {"num_warps": LAUNCH["bwd_scan"]["WIDE_WARPS"],
                                                 "num_stages": LAUNCH["bwd_scan"]["WIDE_STAGES"]})
    elif BK <= 64:
        opts = {**opts, "num_stages": LAUNCH["bwd_scan"]["SMALL_K_STAGES"]}
    return bv, opts


def _bv(name: str, V: int) -> int:
    return max(16, min(LAUNCH[name]["BV"], triton.next_power_of_2(V)))


HALF_INPUT_PRECISION = "bf16x3"  # the intra kernel's diagonal (anchored) dots for bf16/fp16 inputs (kda.md 3.3)
# the choices of LAUNCH[...]["PREC"]: bf16x3 (three bf16 MMAs, near fp32), tf32 (one, 10-bit mantissas), bf16
# (operands rounded to bf16, one MMA)
INTER_PRECISIONS = ("bf16x3", "tf32", "bf16")


def inter_k_block(BK: int, prec: str) -> int:
    """The inter kernel's K block: LAUNCH["bwd_inter"]["BK"], at most BK (next_pow2(K)), and with tf32x3 dots (fp32
    inputs) at least 32 (or BK when K <= 16: one block, untried on a GPU): at K block 16 of K = 32 (two blocks,
    64-token chunks) that launch read an illegal address on the H200 (Triton 3.6, 2026-11-30, RESULTS.md session 14),
    where ieee and tf32 passed."""
    bkb = min(BK, LAUNCH["bwd_inter"]["BK"])
    return min(BK, max(bkb, 32)) if prec == "tf32x3" else bkb


def _prec(name: str, dtype: torch.dtype) -> str:
    """Dot precision of backward kernel `name` (of the intra kernel's off-diagonal dots): for fp32 inputs
    triton_common.fp32_dot_precision() (tf32x3 unless K3_KDA_FP32_DOTS says otherwise); for bf16/fp16,
    LAUNCH[name]["PREC"]."""
    if dtype == torch.float32:
        return fp32_dot_precision()
    prec = LAUNCH[name]["PREC"]
    if prec not in INTER_PRECISIONS:
        raise ValueError(f"triton_chunk_bwd.LAUNCH[{name!r}]['PREC'] = {prec!r}; use one of {INTER_PRECISIONS}")
    return _interpreted(prec)


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the inter kernel's partial dq / dk for inputs of `dtype`: fp32, or with LAUNCH["bwd_inter"]
    ["HALF_PARTIALS"] the inputs' half dtype (their one use adds them to the intra kernel's fp32 terms before dq / dk
    are rounded to that dtype anyway)."""
    half = LAUNCH["bwd_inter"]["HALF_PARTIALS"] and dtype in (torch.bfloat16, torch.float16)
    return dtype if half else torch.float32


def _interpreted(prec: str) -> str:
    """`prec` as Triton 3.6's CPU interpreter can run it: it has no bf16x3 (and multiplies every dot in fp32, so
    'ieee' is the same arithmetic), and its bf16 dots are broken (triton_common._dot emulates them)."""
    if not triton_interpreter():
        return prec
    return {"bf16x3": "ieee", "bf16": "bf16_emulated"}.get(prec, prec)


@triton.jit
def _operand(x, PREC: tl.constexpr):
    """A loaded tile as the operand of `_dot`: bf16 under bf16 dots (which round to it anyway), else fp32."""
    if PREC == "bf16":
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _bwd_scan_kernel(qg, kg, w, Gam, Aqk, do, dht, dvn, dhs, dh0, cu_seqlens, chunk_offsets, T, NT,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr, VARLEN: tl.constexpr,
                     PREC: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr):
    """HAS_DHT: the final state's gradient dht is given (else zero: no zero-filled buffer read); STORE_DH0: the
    initial state's gradient dh0 is stored (only with an initial state). At (8, 4096, 16, 128) each was an 8 MB
    fp32 buffer filled or written and thrown away on every backward without states (~3 us each on the H200).
    SPLIT (heads with K > 128: BK = next_pow2(K) / 2 then): the state gradient held as two [BK, BV] K halves,
    each with its own key-side tiles and dots, so that no [BT, 2 BK] operand is staged in shared memory whole. In one
    piece an fp32 reverse scan at K = 256 asked for 233,472 bytes of shared memory at 1 stage, above the H200's
    232,448 (2026-11-30, RESULTS.md session 13)."""
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, n_chunks = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, NT, BT, VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_t = tl.arange(0, BT)
    # gradient of the state leaving the chunk, first K half (the whole K without SPLIT) and second half
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh = _bwd_scan_state(dht, ((i_n * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :], o_k, m_v, K)
    b_dh2 = tl.zeros([BK, BV], dtype=tl.float32)
    if SPLIT and HAS_DHT:
        b_dh2 = _bwd_scan_state(dht, ((i_n * HV + i_hv) * K + BK + o_k[:, None]) * V + o_v[None, :], BK + o_k, m_v,
                                K)
    # reverse over the sequence's chunks; tl.range, not while, so a GPU compile software-pipelines the loads (as in
    # the forward scan, triton_chunk._scan_kernel)
    for i_c in tl.range(0, n_chunks):
        c = n_chunks - 1 - i_c
        start = bos + c * BT
        n_valid = tl.minimum(eos - start, BT).to(tl.int32)
        m_t = o_t < n_valid
        m_tv = m_t[:, None] & m_v[None, :]
        p_hs = (((c0 + c) * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(dhs + p_hs, b_dh.to(dhs.dtype.element_ty), mask=(o_k < K)[:, None] & m_v[None, :])
        if SPLIT:
            tl.store(dhs + p_hs + BK * V, b_dh2.to(dhs.dtype.element_ty), mask=(BK + o_k < K)[:, None] & m_v[None, :])
        p_tv = ((start + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        # dot operands in the dtype the dot takes them in (_operand: no fp32 round trip under bf16 dots)
        b_A = _operand(_load_lower_blocks(Aqk + ((start + o_t[:, None]) * HV + i_hv) * BT + o_t[None, :], o_t, m_t),
                       PREC)
        b_do = _operand(tl.load(do + p_tv, mask=m_tv, other=0.0), PREC)
        # kg = k e^(Gamma_last - Gamma) and qg = scale q e^Gamma from the w/u kernel: no exponentials and no fp32
        # Gamma tile in this sequential loop; zero rows past the end
        b_dvn = _dot(tl.trans(b_A), b_do, PREC) + _dot(_bwd_scan_keys(kg, start, m_t, i_hv, o_k, HV, K, BT, PREC),
                                                       b_dh, PREC)
        if SPLIT:
            b_dvn += _dot(_bwd_scan_keys(kg, start, m_t, i_hv, BK + o_k, HV, K, BT, PREC), b_dh2, PREC)
        tl.store(dvn + p_tv, b_dvn.to(dvn.dtype.element_ty), mask=m_tv)
        b_dh = _bwd_scan_step(b_dh, qg, w, Gam, b_do, b_dvn, start, n_valid, m_t, i_hv, o_k, HV, K, BT, PREC)
        if SPLIT:
            b_dh2 = _bwd_scan_step(b_dh2, qg, w, Gam, b_do, b_dvn, start, n_valid, m_t, i_hv, BK + o_k, HV, K, BT,
                                   PREC)
    p_state = ((i_n * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
    if STORE_DH0:
        tl.store(dh0 + p_state, b_dh, mask=(o_k < K)[:, None] & m_v[None, :])
        if SPLIT:
            tl.store(dh0 + p_state + BK * V, b_dh2, mask=(BK + o_k < K)[:, None] & m_v[None, :])


@triton.jit
def _bwd_scan_state(dht, p_state, o_k, m_v, K: tl.constexpr):
    """Rows o_k of the final state's gradient [BK, BV] fp32 (rows past K: 0)."""
    return tl.load(dht + p_state, mask=(o_k < K)[:, None] & m_v[None, :], other=0.0).to(tl.float32)


@triton.jit
def _bwd_scan_keys(x, start, m_t, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   PREC: tl.constexpr):
    """Columns o_k of one chunk's [BT, K] tile of x (kg, qg or w) as a dot operand [BT, BK]; zero past the end."""
    o_t = tl.arange(0, BT)
    p = ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
    return _operand(tl.load(x + p, mask=m_t[:, None] & (o_k < K)[None, :], other=0.0), PREC)


@triton.jit
def _bwd_scan_step(b_dh, qg, w, Gam, b_do, b_dvn, start, n_valid, m_t, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, PREC: tl.constexpr):
    """Rows o_k of the state gradient one chunk back: dh Diag(e^Gamma_last) + qg^T do - w^T dv_new."""
    b_Gl = tl.load(Gam + ((start + n_valid - 1) * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)
    b_qg = _bwd_scan_keys(qg, start, m_t, i_hv, o_k, HV, K, BT, PREC)
    b_w = _bwd_scan_keys(w, start, m_t, i_hv, o_k, HV, K, BT, PREC)
    return b_dh * tl.exp2(b_Gl)[:, None] + _dot(tl.trans(b_qg), b_do, PREC) - _dot(tl.trans(b_w), b_dvn, PREC)


@triton.jit
def _bwd_inter_kernel(q, k, v, beta, Gam, Akk, Mm, vnew, hbuf, dhs, do, dvn, dv, dAq, dAk, dqs, dkk, dG, db,
                      chunk_indices, cu_seqlens, scale, T, NT, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr,
                      PREC: tl.constexpr, EARLY: tl.constexpr):
    """Runtime loops over K blocks of BKB (outer) and V blocks of BV (inner). The per-key accumulators (dqg, dkg,
    dkb) then live as [BT, BKB] tiles: with BKB = 64 at K = 128 half the registers of one [BT, K] pass, at the cost
    of re-reading the V-side tiles once per K block. The V-side results (dv, dAqk, d(beta) from v, dL = -dvb v_new^T:
    no read of u or w, and one dot fewer per K block) are taken in the first K pass only; d(beta) accumulates over the
    K blocks, and both are stored after the last. EARLY (LAUNCH["bwd_inter"]["EARLY_LOADS"]) issues loads sooner, so
    their latency overlaps other work instead of adding to it, at the cost of registers live longer: >= 1, a K
    block's key-side tiles (Gamma, k, q) before its V loop rather than after it; 2, also v with the V loop's other
    tiles and Akk before the K loop (ptxas, sm_90a, 8 warps, bytes spilled a thread at K = 64 / 128: 0 / 0 at 0,
    0 / 76 at 1, 12 / 124 at 2)."""
    scale = _f32(scale)  # fp64 when inductor launches us
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_valid
    p_tt = ((start + o_t[:, None]) * HV + i_hv) * BT + o_t[None, :]
    b_b = tl.load(beta + (start + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_M = _load_tril(Mm + p_tt, o_t, m_t, False).to(tl.float32)
    b_dAq = tl.zeros([BT, BT], dtype=tl.float32)
    b_dL = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    p_h = (i_t.to(tl.int64) * HV + i_hv) * K * V
    if EARLY >= 2:
        b_Akk = _load_tril(Akk + p_tt, o_t, m_t, True)
    for i_k in range(0, K, BKB):  # runtime loops, not unrolled: fewer live registers
        o_k = i_k + tl.arange(0, BKB)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
        p_qk = ((start + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        b_dqg = tl.zeros([BT, BKB], dtype=tl.float32)
        b_dkg = tl.zeros([BT, BKB], dtype=tl.float32)
        b_dkb = tl.zeros([BT, BKB], dtype=tl.float32)  # d(beta k e^Gamma) = M^T dw = -(M^T dv_new) h^T
        b_dlast = tl.zeros([BKB], dtype=tl.float32)  # sum_v dh' h: d(decay e^Gamma_last) before the factor
        if EARLY >= 1:
            b_G = tl.load(Gam + p_tk, mask=m_tk, other=0.0)
            b_kr = tl.load(k + p_qk, mask=m_tk, other=0.0)
            b_qr = tl.load(q + p_qk, mask=m_tk, other=0.0)
        for i_v in range(0, V, BV):
            o_v = i_v + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            p_tv = ((start + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
            p_kv = p_h + o_k[:, None] * V + o_v[None, :]
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0).to(tl.float32)
            b_vn = tl.load(vnew + p_tv, mask=m_tv, other=0.0).to(tl.float32)
            b_dvn = _operand(tl.load(dvn + p_tv, mask=m_tv, other=0.0), PREC)  # bf16 with bf16 states
            b_h = tl.load(hbuf + p_kv, mask=m_kv, other=0.0).to(tl.float32)  # state entering the chunk [BKB, BV]
            b_dh = tl.load(dhs + p_kv, mask=m_kv, other=0.0).to(tl.float32)  # grad. of the state leaving it
            if EARLY >= 2:
                b_vr = tl.load(v + p_tv, mask=m_tv & (i_k == 0), other=0.0)
            b_dqg += _dot(b_do, tl.trans(b_h), PREC)
            b_dkg += _dot(b_vn, tl.trans(b_dh), PREC)
            b_dvb = _dot(tl.trans(b_M), b_dvn, PREC)  # d(beta v)
            b_dkb -= _dot(b_dvb, tl.trans(b_h), PREC)
            b_dlast += tl.sum(b_dh * b_h, axis=1)
            if i_k == 0:  # the V-side results, once
                b_dAq += _dot(b_do, tl.trans(b_vn), PREC)
                tl.store(dv + p_tv, (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
                b_dL -= _dot(b_dvb, tl.trans(b_vn), PREC)  # dvb u^T + dkb w^T = dvb (u - w h)^T = dvb v_new^T
                if EARLY < 2:
                    b_vr = tl.load(v + p_tv, mask=m_tv, other=0.0)
                b_db += tl.sum(b_dvb * b_vr.to(tl.float32), axis=1)
        if EARLY < 1:  # this K block's key-side tiles, loaded only after its V loop (fewer live registers)
            b_G = tl.load(Gam + p_tk, mask=m_tk, other=0.0)
            b_kr = tl.load(k + p_qk, mask=m_tk, other=0.0)
            b_qr = tl.load(q + p_qk, mask=m_tk, other=0.0)
        b_Gl = tl.load(Gam + ((start + n_valid - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
        b_k = b_kr.to(tl.float32)
        b_q = b_qr.to(tl.float32) * scale
        b_eG = tl.exp2(b_G)
        b_kb = b_dkb * b_eG
        b_db += tl.sum(b_kb * b_k, axis=1)
        b_eL = tl.exp2(tl.where(m_tk, b_Gl[None, :] - b_G, float("-inf")))  # e^(Gamma_last - Gamma) <= 1
        b_kg = b_k * b_eL
        b_dGc = b_dqg * b_q * b_eG + b_b[:, None] * b_kb * b_k - b_dkg * b_kg
        b_dlast = b_dlast * tl.exp2(b_Gl) + tl.sum(b_dkg * b_kg, axis=0)
        b_dGc += tl.where(o_t[:, None] == n_valid - 1, b_dlast[None, :], 0.0)
        tl.store(dqs + p_tk, (b_dqg * b_eG).to(dqs.dtype.element_ty), mask=m_tk)
        tl.store(dkk + p_tk, (b_b[:, None] * b_kb + b_dkg * b_eL).to(dkk.dtype.element_ty), mask=m_tk)
        tl.store(dG + p_tk, b_dGc, mask=m_tk)
    m_strict = m_t[:, None] & (o_t[None, :] < o_t[:, None])
    b_dL = tl.where(m_strict, b_dL, 0.0)
    if EARLY < 2:
        b_Akk = _load_tril(Akk + p_tt, o_t, m_t, True)
    b_db += tl.sum(b_dL * b_Akk, axis=1)
    tl.store(db + (start + o_t) * HV + i_hv, b_db.to(db.dtype.element_ty), mask=m_t)
    tl.store(dAq + p_tt, tl.where(o_t[None, :] <= o_t[:, None], b_dAq, 0.0), mask=m_t[:, None])
    tl.store(dAk + p_tt, b_dL * b_b[:, None], mask=m_t[:, None])


def recompute_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(hbuf, kg / qg) dtypes the backward reads for inputs of `dtype`. The states entering each chunk: bf16 for bf16
    inputs with bf16 inter dots (which round them to bf16 anyway; the scans carry them in fp32), else fp32. kg = k
    e^(Gamma_last - Gamma) and qg = scale q e^Gamma for the reverse scan: the input dtype when the scan's dots round
    them to it anyway (bf16 dots, or fp32 inputs), else fp32. A training forward keeps its own w, v_new, states,
    kg and qg for the backward only when they have these dtypes (triton_chunk.chunk_fwd_pipeline's keep_states)."""
    half_states = dtype == torch.bfloat16 and _prec("bwd_inter", dtype) == "bf16"
    kq = dtype if dtype == torch.float32 or _prec("bwd_scan", dtype) in ("bf16", "bf16_emulated") else torch.float32
    return (dtype if half_states else torch.float32), kq


def chunk_bwd_triton(q, k, v, beta, h0, Gam, Aqk, Akk, Mm, do, dht, *, scale, safe_shift, chunk_size, cu_seqlens,
                     cu_host=None, states=None, rstd=None, o=None):
    """Gradients of the chunkwise KDA core from what a training forward saved (triton_chunk._ChunkKDATriton).
    q, k: [B, T, H, K] (unscaled); v: [B, T, HV, V]; beta: [B, T, HV] (any float dtype); h0: [N, HV, K, V] fp32 or None;
    the forward's Gam: [T_all, HV, K] fp32 (log2 units), Aqk: [T_all, HV, BT] (input dtype), Akk: [T_all, HV, BT]
    fp32, Mm: [T_all, HV, BT] (input dtype); do: [B, T, HV, V]; dht: [N, HV, K, V] or None. states: the forward's
    (w, vnew, hbuf, kg, qg) in recompute_dtypes (chunk_fwd_pipeline's keep_states), or None: then only those are
    recomputed (triton_chunk.chunk_fwd_states). cu_host: cu_seqlens as host ints, or None.
    rstd: None, or (rq, rk) [B T H] fp32 when q and k are the outputs of the L2 norm (triton_l2norm.l2norm_fwd): dq
    and dk are then the gradients of its inputs, through the backward intra kernel's NORM epilogue when one of its K
    blocks holds a head (K <= 64 as launched) and q / k heads are not shared (HV = H), else l2norm_bwd_from_y; but
    with the forward's output `o` [B, T, HV, V] and LAUNCH["bwd_intra"]["Q_NORM_OUT"], q's in the intra kernel
    whatever its K block (heads not shared).
    Returns (dq, dk [B, T, H, K] in q.dtype, dv [B, T, HV, V] in v.dtype, dg [B, T, HV, K] fp32,
    dbeta [B, T, HV] in beta's dtype, dh0 [N, HV, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dt = q.device, q.dtype
    BT, BC = chunk_size, SUB_CHUNK
    BK = max(16, triton.next_power_of_2(K))
    # the intra kernel's diagonal dots
    prec = fp32_dot_precision() if dt == torch.float32 else _interpreted(HALF_INPUT_PRECISION)
    # bf16 inputs with bf16 inter dots: the states entering each chunk (hbuf) and the state gradients (dhs) are
    # stored in bf16 (recompute_dtypes); half the bytes of the two [NT_all, HV, K, V] buffers (fla-core 0.6.0 keeps
    # h and dh in bf16 too)
    h_dtype, kq_dtype = recompute_dtypes(dt)
    if states is None:
        # u: read by the recompute's scan alone (v_new = u - w h); the inter kernel takes v_new
        w, _, vnew, hbuf, _, kg, qg = chunk_fwd_states(k, v, beta, Gam, Mm, h0, chunk_size=BT, cu_seqlens=cu_seqlens,
                                                       h_fp32=h_dtype == torch.float32, cu_host=cu_host, q=q,
                                                       scale=scale, kq_dtype=kq_dtype)
    else:
        w, vnew, hbuf, kg, qg = states
    q, k, v = q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous()
    beta = beta.contiguous()
    N, NT, NT_all, chunk_indices, chunk_offsets, cu = chunk_layout(B, T, BT, cu_seqlens, dev, cu_host)
    varlen = cu_seqlens is not None
    if not varlen:
        chunk_indices = chunk_offsets = cu = q  # unused placeholders
    T_all = B * T
    f32 = torch.float32
    do = do.contiguous()
    has_dht = dht is not None
    dht = dht.float().contiguous() if has_dht else None
    # dv_new (scan -> inter kernel, where its one use is a dot operand rounded to bf16 under bf16 dots): stored in
    # bf16 with the states, the same values at half the bytes
    dvn = torch.empty(T_all, HV, V, dtype=h_dtype, device=dev)
    dhs = torch.empty(NT_all, HV, K, V, dtype=hbuf.dtype, device=dev)
    dh0 = torch.empty(N, HV, K, V, dtype=f32, device=dev) if h0 is not None else None
    dv = torch.empty(T_all, HV, V, dtype=v.dtype, device=dev)  # final: stored in v's dtype by the kernel
    dAq = torch.empty(T_all, HV, BT, dtype=f32, device=dev)
    dAk = torch.empty(T_all, HV, BT, dtype=f32, device=dev)
    dqs, dkk = (torch.empty(T_all, HV, K, dtype=partial_dtype(dt), device=dev) for _ in range(2))
    dG = torch.empty(T_all, HV, K, dtype=f32, device=dev)
    G = HV // H  # GVA: a q/k head's gradient sums over the value heads that share it
    BKi, opts = intra_launch(BK)  # the intra kernel's K block: one program per block
    norm_fused = rstd is not None and G == 1 and BKi >= K  # the L2 norm's backward in the intra kernel
    q_norm_out = rstd is not None and o is not None and q_norm_from_output(H, HV, K)  # q's alone there
    # dq and dk are written once per element (final without GVA: stored in q's dtype); dg (dGamma, then its
    # in-chunk reverse cumsum in place) stays fp32
    dq, dk = (torch.empty(T_all, HV, K, dtype=dt if G == 1 else f32, device=dev) for _ in range(2))
    dg = torch.empty(T_all, HV, K, dtype=f32, device=dev)
    db = torch.empty(T_all, HV, dtype=beta.dtype, device=dev)  # stored by the inter kernel in beta's dtype
    if NT_all == 0 or HV == 0:
        if dh0 is not None and has_dht:
            dh0.copy_(dht)
        elif dh0 is not None:
            dh0.zero_()
        for t in (dq, dk, dv, dg, db):
            t.zero_()
    else:
        BVs, scan_opts = bwd_scan_launch(V, BK, N * HV, device_sms(dev))
        # placeholders (dvn) for the state gradients not read (no dht) or not written (no h0)
        scan_args = (qg, kg, w, Gam, Aqk, do, dht if has_dht else dvn, dvn, dhs, dh0 if dh0 is not None else dvn, cu,
                     chunk_offsets, T, NT)
        split = BK > 128  # the state gradient in two K halves (the kernel's SPLIT)
        scan = {"H": H, "HV": HV, "K": K, "V": V, "BV": BVs, "BT": BT, "SPLIT": split, "VARLEN": varlen,
                "PREC": _prec("bwd_scan", dt), "HAS_DHT": has_dht, "STORE_DH0": dh0 is not None, **scan_opts}
        launch_fitting(_bwd_scan_kernel, (triton.cdiv(V, BVs), N, HV), *scan_args, BK=BK // 2 if split else BK, **scan)
        del kg, qg
        BVi, iprec = _bv("bwd_inter", V), _prec("bwd_inter", dt)  # not `prec`: the intra kernel's diagonal dots
        _bwd_inter_kernel[(NT_all, HV)](q, k, v, beta, Gam, Akk, Mm, vnew, hbuf, dhs, do, dvn, dv, dAq, dAk, dqs,
                                        dkk, dG, db, chunk_indices, cu, float(scale), T, NT, H=H, HV=HV, K=K, V=V,
                                        BKB=inter_k_block(BK, iprec), BV=BVi, BT=BT, VARLEN=varlen, PREC=iprec,
                                        EARLY=LAUNCH["bwd_inter"]["EARLY_LOADS"], **_opts("bwd_inter"))
        shift = 0.0 if safe_shift is None else safe_shift * RCP_LN2
        intra = {"H": H, "HV": HV, "K": K, "BK": BKi, "BT": BT, "BC": BC, "NC": BT // BC,
                 "SAFE": safe_shift is not None, "VARLEN": varlen, "PREC": prec, "OFF": _prec("bwd_intra", dt),
                 "NORM": norm_fused, "Q_NORM_OUT": q_norm_out, "V": V, "BV": triton.next_power_of_2(V), **opts}
        rq, rk = rstd if norm_fused or q_norm_out else (dq, dk)  # unused placeholders without NORM
        oo = o.contiguous() if q_norm_out else dq  # (placeholders)
        args = (q, k, Gam, dAq, dAk, dqs, dkk, dG, dq, dk, dg, rq, rk, oo, do if q_norm_out else dq, chunk_indices,
                cu, float(scale), shift, T, NT)
        _bwd_intra_kernel[(NT_all * (BT // BC) * triton.cdiv(K, BKi), HV)](*args, **intra)
        BKg = max(16, min(BK, LAUNCH["bwd_dg"]["BK"]))
        _bwd_dg_kernel[(NT_all * triton.cdiv(K, BKg), HV)](dg, chunk_indices, cu, T, NT, HV=HV, K=K, BK=BKg, BT=BT,
                                                           VARLEN=varlen, **_opts("bwd_dg"))
    if G == 1:
        dq, dk = dq.view(B, T, H, K), dk.view(B, T, H, K)
    else:
        dq, dk = dq.view(B, T, H, G, K).sum(3).to(dt), dk.view(B, T, H, G, K).sum(3).to(dt)
    if rstd is not None and not (norm_fused and NT_all):
        if not (q_norm_out and NT_all):
            dq = l2norm_bwd_from_y(q.view(dq.shape), rstd[0], dq)
        dk = l2norm_bwd_from_y(k.view(dk.shape), rstd[1], dk)
    return (dq, dk, dv.view(B, T, HV, V).to(v.dtype), dg.view(B, T, HV, K), db.view(B, T, HV),
            dh0)
