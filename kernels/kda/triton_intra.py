"""Intra-chunk step of the Triton KDA forward, "rows" variant: Gamma, Aqk, L (and Akk) by two kernels over many
small programs (selected by triton_chunk.LAUNCH["intra"]["variant"] = "rows" or K3_KDA_INTRA=rows).

Legend (as triton_chunk.py): T_all total tokens, H q/k heads, HV value heads, K key dim, BT chunk size, BC = 16
sub-chunk, NC = BT / BC, NT_all chunks over all sequences, BK = next_pow2(K), BKB = min(64, BK) the K block.

Why: v1 (`triton_chunk._intra_kernel`) runs one program per (chunk, value head) holding [BT, BK] fp32 tiles of Gamma,
k and their decayed copies at once: at BT = 64, K = 128 that is 255 registers with spills on an H200, and only
NT_all * HV programs. Here (the same equations, kda.md 3.1-3.3; the split over more, smaller programs that loop over
K in blocks is the design fla 0.6.0 describes for its `chunk_kda` intra step):
1. `_intra_gamma_kernel`, grid (NT_all, cdiv(K, BKB), HV): Gam = chunk-local cumsum(g) / ln 2, fp32, [T_all, HV, K];
   rows past the sequence end are not stored (as v1).
2. `_intra_rows_kernel`, grid (NT_all, NC, HV): program (chunk, sub-chunk s, value head) writes rows
   s*BC .. s*BC + BC - 1 of Aqk [T_all, HV, BT] (scale q k^T with decay, j <= i), Lkk (= diag(beta) Akk, j < i) and,
   for the backward, Akk (k k^T with decay, no beta, fp32), looping over K in blocks of BKB and accumulating in fp32
   (the sums over the key dimension are separable):
     off-diagonal columns j < s*BC: anchor Gamma_n = Gamma of row s*BC, query factor exp2(Gamma_i - Gamma_n) <= 1,
       key factor exp2(Gamma_n - Gamma_j) <= 1 on a [BT, BKB] key tile masked to rows j < s*BC (kda.md 3.3);
     diagonal [BC, BC] block: v1's `_diag_block` on the K block (SAFE: fixed anchor C = Gamma_n - shift, one dot;
       otherwise exact pairwise exponents one column at a time), summed over the K blocks.
Gamma of rows past the sequence end is read as the last valid row's (v1 loads g = 0 there: the cumsum stands still),
so every padded row that enters a dot stays finite; its stores are masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _chunk_bounds, _diag_block

# Launch settings of the two kernels (swept by benchmarks/kda_tune.py as triton_chunk.LAUNCH is), and the cap on
# the rows kernel's K block. Not yet timed on a GPU: 4 warps as v1's intra kernel; 2 stages let the K-block loop
# prefetch the next block's Gamma rows. With BKB = 64 an offline sm_90a compile (ptxas 12.8) of the rows kernel
# (bf16, K = 128) uses 244-248 registers and spills nothing, where v1's intra kernel spills ~500 bytes.
LAUNCH: dict[str, dict[str, int]] = {
    "intra_gamma": {"num_warps": 4, "num_stages": 1},
    "intra_rows": {"num_warps": 4, "num_stages": 2, "BKB": 64},
}


def k_block(BK: int) -> int:
    """BKB, the rows kernel's K block: min(LAUNCH["intra_rows"]["BKB"] (64), BK), at least 16 (tl.dot). At BT = 64
    and 4 warps one [BT, 64] fp32 tile is 32 registers a thread."""
    cap = LAUNCH["intra_rows"]["BKB"]
    if cap < 16 or cap & (cap - 1):
        raise ValueError(f'triton_intra.LAUNCH["intra_rows"]["BKB"] must be a power of 2 >= 16 (tl.dot), got {cap}')
    return max(16, min(cap, BK))


@triton.jit
def _intra_gamma_kernel(g, Gam, chunk_indices, cu_seqlens, T, NT, HV: tl.constexpr, K: tl.constexpr,
                        BKB: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr):
    i_t, i_k, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BKB + tl.arange(0, BKB)
    m_tk = (o_t < n_valid)[:, None] & (o_k < K)[None, :]
    p_tk = ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
    b_g = tl.load(g + p_tk, mask=m_tk, other=0.0)  # [BT, BKB]; padded rows 0 (identity steps), as v1
    tl.store(Gam + p_tk, tl.cumsum(b_g.to(tl.float32), axis=0) * 1.4426950408889634, mask=m_tk)


@triton.jit
def _intra_rows_kernel(q, k, beta, Gam, Aqk, Lkk, Akk, chunk_indices, cu_seqlens, scale, shift, T, NT,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKB: tl.constexpr, BT: tl.constexpr,
                       BC: tl.constexpr, SAFE: tl.constexpr, STORE_AKK: tl.constexpr, VARLEN: tl.constexpr,
                       PREC: tl.constexpr):
    i_t, i_s, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    r0 = i_s * BC  # first row of this sub-chunk within the chunk
    if r0 >= n_valid:  # a sub-chunk wholly past the sequence end: v1 stores nothing for it either
        return
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    r_s = r0 + o_c  # [BC] rows of the sub-chunk
    m_s = r_s < n_valid
    r_g = tl.minimum(r_s, n_valid - 1)  # Gamma rows: past the end, the last valid row's value (v1's g = 0 there)
    m_key = o_t < r0  # [BT] keys of earlier sub-chunks (all valid: r0 < n_valid)
    b_Aoff = tl.zeros([BC, BT], dtype=tl.float32)  # q_i k_j, j < r0, with decay
    b_Loff = tl.zeros([BC, BT], dtype=tl.float32)  # k_i k_j, j < r0, with decay (no beta)
    b_Ad = tl.zeros([BC, BC], dtype=tl.float32)  # diagonal block of Aqk (j <= i)
    b_Ld = tl.zeros([BC, BC], dtype=tl.float32)  # diagonal block of Akk (j < i)
    for i_k in range(0, K, BKB):  # a loop, not unrolled: one K block's tiles live at a time
        o_k = i_k + tl.arange(0, BKB)
        m_k = o_k < K
        m_sk = m_s[:, None] & m_k[None, :]
        p_qk = ((start + r_s[:, None]) * H + i_h) * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_sk, other=0.0).to(tl.float32) * scale  # [BC, BKB]
        b_k = tl.load(k + p_qk, mask=m_sk, other=0.0).to(tl.float32)  # [BC, BKB]
        b_Gs = tl.load(Gam + ((start + r_g[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_Gn = tl.load(Gam + ((start + r0) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # anchor row [BKB]
        if i_s > 0:  # off-diagonal columns j < r0: both exponents <= 0 (kda.md 3.3)
            e_q = tl.exp2(b_Gs - b_Gn[None, :])
            m_tk = m_key[:, None] & m_k[None, :]
            p_tk = ((start + o_t[:, None]) * H + i_h) * K + o_k[None, :]
            b_kt = tl.load(k + p_tk, mask=m_tk, other=0.0)  # [BT, BKB], zero rows from r0 on
            b_Gt = tl.load(Gam + ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
            e_k = tl.exp2(tl.where(m_key[:, None], b_Gn[None, :] - b_Gt, float("-inf")))
            b_kc = (b_kt.to(tl.float32) * e_k).to(b_kt.dtype)  # in the input dtype, as v1's dot operands
            b_Aoff += tl.dot((b_q * e_q).to(b_kt.dtype), tl.trans(b_kc), input_precision=PREC)  # [BC, BT]
            b_Loff += tl.dot((b_k * e_q).to(b_kt.dtype), tl.trans(b_kc), input_precision=PREC)
        b_a, b_l = _diag_block(b_q, b_k, b_Gs, b_Gn, shift, BC, SAFE, PREC)  # this K block's share, masked
        b_Ad += b_a
        b_Ld += b_l
    b_b = tl.load(beta + (start + r_s) * HV + i_hv, mask=m_s, other=0.0).to(tl.float32)
    # whole rows, as v1: off-diagonal columns (zero from r0 on) everywhere but the diagonal block, then that block
    p_A = ((start + r_s[:, None]) * HV + i_hv) * BT + o_t[None, :]
    m_off = m_s[:, None] & ((o_t[None, :] < r0) | (o_t[None, :] >= r0 + BC))
    tl.store(Aqk + p_A, b_Aoff.to(Aqk.dtype.element_ty), mask=m_off)
    if STORE_AKK:  # k k^T with decay, without beta: the backward's d(beta) needs it
        tl.store(Akk + p_A, b_Loff, mask=m_off)
    tl.store(Lkk + p_A, b_Loff * b_b[:, None], mask=m_off)
    p_D = ((start + r_s[:, None]) * HV + i_hv) * BT + r0 + o_c[None, :]
    tl.store(Aqk + p_D, b_Ad.to(Aqk.dtype.element_ty), mask=m_s[:, None])
    if STORE_AKK:
        tl.store(Akk + p_D, b_Ld, mask=m_s[:, None])
    tl.store(Lkk + p_D, b_Ld * b_b[:, None], mask=m_s[:, None])


def intra_rows(q, k, g, beta, Gam, Aqk, Lkk, Akk, chunk_indices, cu_seqlens, *, scale: float, shift: float, T: int,
               NT: int, NT_all: int, BT: int, BC: int, safe: bool, store_akk: bool, varlen: bool, prec: str) -> None:
    """Fill Gam, Aqk, Lkk (and Akk when `store_akk`) as `triton_chunk._intra_kernel` does, with the two kernels above.

    q, k: [T_all, H, K] (any contiguous layout that flattens to it, e.g. [B, T, H, K]); g: [.., HV, K] fp32 log decay;
    beta: [.., HV]; outputs (preallocated): Gam [T_all, HV, K] fp32, Aqk [T_all, HV, BT] in the input dtype, Lkk and
    Akk [T_all, HV, BT] fp32 (Akk may alias Lkk when not stored). `shift` is the safe-gate anchor shift in log2
    units (used when `safe`); chunk_indices / cu_seqlens as triton_chunk.chunk_layout returns them (placeholders
    without varlen); T, NT: the fixed-length sequence length and chunks per sequence."""
    H, K = q.shape[-2], q.shape[-1]
    HV = beta.shape[-1]
    BKB = k_block(max(16, triton.next_power_of_2(K)))
    gopt, ropt = LAUNCH["intra_gamma"], LAUNCH["intra_rows"]
    _intra_gamma_kernel[(NT_all, triton.cdiv(K, BKB), HV)](
        g, Gam, chunk_indices, cu_seqlens, T, NT, HV=HV, K=K, BKB=BKB, BT=BT, VARLEN=varlen,
        num_warps=gopt["num_warps"], num_stages=gopt["num_stages"])
    _intra_rows_kernel[(NT_all, BT // BC, HV)](
        q, k, beta, Gam, Aqk, Lkk, Akk, chunk_indices, cu_seqlens, scale, shift, T, NT, H=H, HV=HV, K=K, BKB=BKB,
        BT=BT, BC=BC, SAFE=safe, STORE_AKK=store_akk, VARLEN=varlen, PREC=prec, num_warps=ropt["num_warps"],
        num_stages=ropt["num_stages"])


__all__ = ["LAUNCH", "intra_rows", "k_block"]
