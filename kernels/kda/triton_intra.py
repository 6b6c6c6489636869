"""Intra-chunk step of the KDA chunk forward, second version (`LAUNCH["intra"]["version"] = 2` in triton_chunk.py).

Same outputs as triton_chunk._intra_kernel (Gamma, Aqk, L = diag(beta) Akk, optionally Akk; legend and equations in
triton_chunk.py), computed block by block as fla does, instead of one [BC, BT] row band per sub-chunk:
1. Gamma sub-chunk by sub-chunk: a 16-row cumsum plus the carried sum of the earlier rows, stored, then re-read
   from global memory (L1/L2-hot) where needed instead of extracting rows from registers with masked reductions;
2. for each query sub-chunk s and each earlier key sub-chunk j < s, one [BC, BC] block with the anchor Gamma_n
   (first row of s): query factor exp2(Gamma_i - Gamma_n) <= 1, key factor exp2(Gamma_n - Gamma_j) <= 1 (kda.md
   3.3) on the 16 keys of block j only. v1 recomputed the key factor over all BT rows for every s (about 3x the
   exp2 work) and multiplied [BC, BK] x [BK, BT] tiles of which half were masked to zero;
3. the diagonal blocks exactly as v1 (fixed anchor with `safe_gate`, exact pairwise exponents otherwise);
4. zeros above the diagonal blocks (the output kernel reads whole rows of Aqk).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk import _chunk_bounds, _diag_block


@triton.jit
def _intra2_kernel(q, k, g, beta, Gam, Aqk, Lkk, Akk, chunk_indices, cu_seqlens, scale, shift, T, NT,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, NC: tl.constexpr, SAFE: tl.constexpr, STORE_AKK: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_c = tl.arange(0, BC)
    # 1. Gamma = chunk-local inclusive cumsum of g, log2 units; padded rows/columns read g = 0 (identity steps)
    b_carry = tl.zeros([BK], dtype=tl.float32)
    for s in tl.static_range(NC):
        r_s = s * BC + o_c
        m_sk = (r_s < n_valid)[:, None] & m_k[None, :]
        p_g = ((start + r_s[:, None]) * HV + i_hv) * K + o_k[None, :]
        b_g = tl.load(g + p_g, mask=m_sk, other=0.0).to(tl.float32) * 1.4426950408889634
        tl.store(Gam + p_g, tl.cumsum(b_g, axis=0) + b_carry[None, :], mask=m_sk)
        b_carry += tl.sum(b_g, axis=0)
    tl.debug_barrier()  # Gamma rows written by other threads of this program are read below
    for s in tl.static_range(NC):
        r_s = s * BC + o_c
        m_s = r_s < n_valid
        m_sk = m_s[:, None] & m_k[None, :]
        p_sk = ((start + r_s[:, None]) * HV + i_hv) * K + o_k[None, :]
        p_sq = ((start + r_s[:, None]) * H + i_h) * K + o_k[None, :]
        b_q = tl.load(q + p_sq, mask=m_sk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + p_sq, mask=m_sk, other=0.0).to(tl.float32)
        b_Gs = tl.load(Gam + p_sk, mask=m_sk, other=0.0)
        # anchor: Gamma of the first row of sub-chunk s (rows past the end: masked stores, values irrelevant)
        b_Gn = tl.load(Gam + ((start + s * BC) * HV + i_hv) * K + o_k, mask=m_k & (s * BC < n_valid), other=0.0)
        b_b = tl.load(beta + (start + r_s) * HV + i_hv, mask=m_s, other=0.0).to(tl.float32)
        p_row = ((start + r_s[:, None]) * HV + i_hv) * BT
        if s > 0:
            e_q = tl.exp2(tl.minimum(b_Gs - b_Gn[None, :], 0.0))
            b_qf = (b_q * e_q).to(k.dtype.element_ty)
            b_kf = (b_k * e_q).to(k.dtype.element_ty)
            for j in tl.static_range(s):  # 2. off-diagonal blocks (s, j), j < s
                r_j = j * BC + o_c
                m_jk = (r_j < n_valid)[:, None] & m_k[None, :]
                b_kj = tl.load(k + ((start + r_j[:, None]) * H + i_h) * K + o_k[None, :], mask=m_jk, other=0.0)
                b_Gj = tl.load(Gam + ((start + r_j[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_jk, other=0.0)
                b_kc = (b_kj.to(tl.float32) * tl.exp2(tl.minimum(b_Gn[None, :] - b_Gj, 0.0))).to(b_kj.dtype)
                b_A = tl.dot(b_qf, tl.trans(b_kc), input_precision=PREC)  # [BC, BC]
                b_L = tl.dot(b_kf, tl.trans(b_kc), input_precision=PREC)
                p_blk = p_row + j * BC + o_c[None, :]
                tl.store(Aqk + p_blk, b_A.to(Aqk.dtype.element_ty), mask=m_s[:, None])
                if STORE_AKK:  # k k^T with decay, without beta: the backward's d(beta) needs it
                    tl.store(Akk + p_blk, b_L, mask=m_s[:, None])
                tl.store(Lkk + p_blk, b_L * b_b[:, None], mask=m_s[:, None])
        b_Ad, b_Ld = _diag_block(b_q, b_k, b_Gs, b_Gn, shift, BC, SAFE, PREC)  # 3. diagonal 16 x 16 block
        p_D = p_row + s * BC + o_c[None, :]
        tl.store(Aqk + p_D, b_Ad.to(Aqk.dtype.element_ty), mask=m_s[:, None])
        if STORE_AKK:
            tl.store(Akk + p_D, b_Ld, mask=m_s[:, None])
        tl.store(Lkk + p_D, b_Ld * b_b[:, None], mask=m_s[:, None])
        for j in tl.static_range(s + 1, NC):  # 4. zeros above the diagonal
            p_up = p_row + j * BC + o_c[None, :]
            b_zero = tl.zeros([BC, BC], dtype=tl.float32)
            tl.store(Aqk + p_up, b_zero.to(Aqk.dtype.element_ty), mask=m_s[:, None])
            if STORE_AKK:
                tl.store(Akk + p_up, b_zero, mask=m_s[:, None])
            tl.store(Lkk + p_up, b_zero, mask=m_s[:, None])
