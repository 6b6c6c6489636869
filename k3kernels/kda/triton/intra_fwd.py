"""The forward's intra-chunk step as a Triton kernel (`_intra_sub_kernel`, step 1 of chunk_fwd.py, which launches it;
legend there): per 16-token sub-chunk, its rows of Gamma, Aqk and L (or Akk), and the diagonal 16 x 16 block
(`_diag_block`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_bounds, _f32, loop_range


@triton.jit
def _diag_block(b_q, b_k, b_Gs, b_en, shift, BC: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr):
    """Diagonal [BC, BC] blocks of one sub-chunk: (Aqk with j <= i, Akk with j < i), fp32, from its rows b_q (scaled),
    b_k [BC, BK] fp32, Gamma b_Gs [BC, BK] relative to the anchor row n (log2 units; zero at row n) and
    b_en = exp2(b_Gs) (the caller's query factor; 0 is fine in rows and columns where b_q and b_k are 0). With SAFE
    the fixed anchor C = Gamma_n - shift = -shift keeps exp2(Gamma_i - C) and exp2(C - Gamma_j) finite in fp32
    (kda.md 3.3); otherwise exact pairwise exponents, one key column j at a time (any g, including -1000)."""
    o_c = tl.arange(0, BC)
    if SAFE:
        # exp2(Gamma_i - C) = exp2(Gamma_i - Gamma_n) exp2(shift): one multiply in place of a tile of exponentials
        e_r = b_en * tl.exp2(shift)
        b_kd = b_k * tl.exp2(-shift - b_Gs)
        b_Ad = tl.dot(b_q * e_r, tl.trans(b_kd), input_precision=PREC)
        b_Ld = tl.dot(b_k * e_r, tl.trans(b_kd), input_precision=PREC)
    else:
        b_Ad = tl.zeros([BC, BC], dtype=tl.float32)
        b_Ld = tl.zeros([BC, BC], dtype=tl.float32)
        for j in tl.static_range(BC):
            sel = o_c[:, None] == j
            b_kj = tl.sum(tl.where(sel, b_k, 0.0), axis=0)  # [BK]
            b_Gj = tl.sum(tl.where(sel, b_Gs, 0.0), axis=0)  # [BK]
            e = tl.exp2(tl.where(o_c[:, None] >= j, b_Gs - b_Gj[None, :], float("-inf")))  # [BC, BK]
            ke = b_kj[None, :] * e
            b_Ad += tl.where(o_c[None, :] == j, tl.sum(b_q * ke, axis=1)[:, None], 0.0)
            b_Ld += tl.where(o_c[None, :] == j, tl.sum(b_k * ke, axis=1)[:, None], 0.0)
    b_Ad = tl.where(o_c[:, None] >= o_c[None, :], b_Ad, 0.0)
    b_Ld = tl.where(o_c[:, None] > o_c[None, :], b_Ld, 0.0)
    return b_Ad, b_Ld


@triton.jit
def _intra_sub_kernel(q, k, g, beta, Gam, Aqk, Lkk, g_ok, qg, q_rstd, chunk_indices, cu_seqlens, scale, shift, g_floor,
                      T, NT, part_stride,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                      BC: tl.constexpr, NC: tl.constexpr, SAFE: tl.constexpr, STORE_AKK: tl.constexpr,
                      CHECK_G: tl.constexpr, STORE_QG: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                      KSPLIT: tl.constexpr, Q_RSTD: tl.constexpr):
    """The forward's intra-chunk step (chunk_fwd.py, step 1), one program per (chunk, 16-token sub-chunk i, value
    head): the BC rows of sub-chunk i of Gamma, Aqk and Lkk, [BC, BK] tiles only (the backward's intra kernel has
    the same shape). Lkk gets L = diag(beta) k k^T with decay, or with STORE_AKK (a training forward) Akk = k k^T
    with decay, without beta (the backward's d(beta) needs it; the solve then applies beta itself): one buffer
    written, not two (fp32; or fp16 for L, chunk_fwd_pipeline's l_fp16). Only the blocks j <= i of Aqk and Lkk are
    written: the solve, the w/u kernel, the scans and the output kernel load no others (_load_lower_blocks,
    _load_tril): writing Aqk's blocks above as zeros too costs this kernel 9 / 25 us at (8, 4096, 16, 128) /
    (16, 2048, 32, 64) with an fp32 L on an H200, and the scan would read 6 more blocks of 16 a chunk.
    One pass over the sub-chunks before i, from i - 1 down to 0: each key's exponent Gamma_n - Gamma_c (<= 0, anchor
    n = the first row of sub-chunk i, kda.md 3.3) is the running sum of g from row c + 1 to row n, and the carry into
    sub-chunk i (the sum of g before it) comes out of the same walk, so Gamma is stored after it. Own rows take Gamma
    relative to the anchor (exactly zero at row n); both factors of an off-diagonal block (j < i) are <= 1. The
    diagonal block by `_diag_block`. Each program reads every earlier sub-chunk's g once (summing them into the
    carry first, then reading them again for the keys, takes 844 us per fwd+bwd against 716 at (8, 4096, 16, 128) on
    an H200).
    CHECK_G: the safe gate's bound check, which then costs no pass of its own over g: a program whose rows hold a g
    below g_floor stores 0 into the flag g_ok (int32 [1], 1 before the launch; every such program stores the same
    value, so the race is harmless). A torch amin over per-program minima would cost ~10-15 us a forward on an
    H200.
    STORE_QG: also store qg = scale q exp2(Gamma) [T_all, HV, K] (the scan's fused output reads it), from the rows
    and Gamma this program holds anyway.
    KSPLIT = 2 (chunk_fwd_pipeline's K split): the two programs 2 s and 2 s + 1 of grid axis 0 take K half p = 0, 1
    of sub-chunk s, columns p BK .. p BK + BK - 1 of q, k, g, Gamma and qg, and store their partial sums of Aqk and
    Lkk at part p of [2, T_all, HV, BT] buffers (part_stride = T_all HV BT elements apart): the solve adds L's, Aqk's
    readers (the fused scan, the output kernel: chunk_fwd._load_aqk) Aqk's. Gamma is per column, so the
    split needs no exchange. The offsets go on the base pointers, so the tiles' index arithmetic is the unsplit
    kernel's. A sub-chunk's two halves are adjacent in the launch order, so they run at about the same time and read
    the two halves of the same rows of q, k and g (neighbouring addresses); on a third grid axis (every first half
    launched before any second) this kernel takes 556 us against 527 at (8, 4096, 16, 128) on an H200.
    Q_RSTD: q is raw and its rows' L2 norms' inverses q_rstd [T_all H] fp32 scale this kernel's results: an
    inference forward's q is read by this kernel alone (its own rows: the walk reads k and g only), so the norm pass
    stores rstd and no normalised copy of q (chunk_fwd_pipeline's q_rstd). The rows are scaled as loaded: scaling
    Aqk's blocks and qg as stored instead is no faster on an H200."""
    scale, shift, g_floor = _f32(scale), _f32(shift), _f32(g_floor)  # fp64 when inductor launches us
    i_s, i_hv = tl.program_id(0) // KSPLIT, tl.program_id(1)  # i_s: the sub-chunk
    i_t, i_i = i_s // NC, i_s % NC
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    if i_i * BC >= n_valid:  # past the end of a partial chunk: no rows
        return
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    if KSPLIT == 2:  # this program's K half: columns k0 .. k0 + BK - 1 through the base pointers
        i_p = tl.program_id(0) % KSPLIT
        k0 = i_p * BK
        q, k, g, Gam, qg = q + k0, k + k0, g + k0, Gam + k0, qg + k0
        Aqk, Lkk = Aqk + i_p * part_stride, Lkk + i_p * part_stride
        m_k = o_k < K - k0
    else:
        m_k = o_k < K
    log2e = 1.4426950408889634
    r_i = i_i * BC + o_c
    m_i = r_i < n_valid
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = ((start + r_i[:, None]) * HV + i_hv) * K + o_k[None, :]
    p_iq = ((start + r_i[:, None]) * H + i_h) * K + o_k[None, :]
    b_gi = tl.load(g + p_ik, mask=m_ik, other=0.0).to(tl.float32)
    if CHECK_G:  # masked entries read 0, above any lower bound
        tl.store(g_ok, tl.full([], 0, tl.int32), mask=tl.min(tl.min(b_gi, axis=1), axis=0) < g_floor)
    # Gamma relative to the anchor n (the sub-chunk's first row, exactly zero there), so the anchor's own Gamma
    # drops out of every exponent below; absolute Gamma is stored once the walk below has the carry
    # g of the anchor row [BK], loaded again (a cache hit) rather than picked out of b_gi by a reduction over rows;
    # with _diag_block's row factor taken from e_q: 129 against 160 ex2 in the PTX (sm_90a), 676 against 698 us at
    # (8, 4096, 16, 128) on an H200
    b_gn = tl.load(g + ((start + i_i * BC) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_G = (tl.cumsum(b_gi, axis=0) - b_gn[None, :]) * log2e
    b_q = tl.load(q + p_iq, mask=m_ik, other=0.0).to(tl.float32) * scale
    if Q_RSTD:
        b_q *= tl.load(q_rstd + (start + r_i) * H + i_h, mask=m_i, other=0.0)[:, None]
    b_k = tl.load(k + p_iq, mask=m_ik, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (start + r_i) * HV + i_hv, mask=m_i, other=0.0).to(tl.float32)
    # Gamma_i - Gamma_n <= 0. Not masked: rows past the end read g = 0 (finite Gamma there) and q = k = 0, so every
    # product with e_q is 0 there as with a masked factor (bit-identical; 32 selects fewer per thread in the PTX)
    e_q = tl.exp2(b_G)
    b_qf = (b_q * e_q).to(k.dtype.element_ty)
    b_kf = (b_k * e_q).to(k.dtype.element_ty)
    p_rows = ((start + r_i[:, None]) * HV + i_hv) * BT  # row r_i of Aqk / Lkk
    # off-diagonal blocks (i, j), j < i, walked downwards from j = i - 1 (b_cj: the sum of g over sub-chunks
    # j + 1 .. i - 1)
    b_cj = tl.zeros([BK], dtype=tl.float32)
    for jb in loop_range(0, i_i):
        j = i_i - 1 - jb
        r_j = j * BC + o_c
        p_jk = ((start + r_j[:, None]) * HV + i_hv) * K + o_k[None, :]
        b_gj = tl.load(g + p_jk, mask=m_k[None, :], other=0.0).to(tl.float32)
        # Gamma_c relative to the anchor: -(g_n + g over sub-chunks j + 1 .. i - 1 + g of rows c + 1 .. of
        # sub-chunk j), every term a sum of g <= 0
        b_tj = tl.sum(b_gj, axis=0)
        b_Gj = (tl.cumsum(b_gj, axis=0) - (b_gn + b_cj + b_tj)[None, :]) * log2e
        b_cj += b_tj
        b_kc = tl.load(k + ((start + r_j[:, None]) * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_kc = (b_kc.to(tl.float32) * tl.exp2(tl.where(m_k[None, :], -b_Gj, float("-inf"))))  # Gamma_n - Gamma_c
        b_kc = b_kc.to(k.dtype.element_ty)
        b_A = tl.dot(b_qf, tl.trans(b_kc), input_precision=PREC)  # [BC, BC]
        b_L = tl.dot(b_kf, tl.trans(b_kc), input_precision=PREC)
        p_b = p_rows + r_j[None, :]
        tl.store(Aqk + p_b, b_A.to(Aqk.dtype.element_ty), mask=m_i[:, None])
        if STORE_AKK:
            tl.store(Lkk + p_b, b_L, mask=m_i[:, None])
        else:
            tl.store(Lkk + p_b, b_L * b_b[:, None], mask=m_i[:, None])
    # absolute Gamma = carry + cumsum, the carry into sub-chunk i being b_cj now
    b_Ga = b_G + ((b_cj + b_gn) * log2e)[None, :]
    tl.store(Gam + p_ik, b_Ga, mask=m_ik)
    if STORE_QG:  # computed as the w/u kernel's recompute does (the backward may read either), bit for bit
        tl.store(qg + p_ik, (b_q * tl.exp2(b_Ga)).to(qg.dtype.element_ty), mask=m_ik)
    b_Ad, b_Ld = _diag_block(b_q, b_k, b_G, e_q, shift, BC, SAFE, PREC)
    p_d = p_rows + r_i[None, :]
    tl.store(Aqk + p_d, b_Ad.to(Aqk.dtype.element_ty), mask=m_i[:, None])
    if STORE_AKK:
        tl.store(Lkk + p_d, b_Ld, mask=m_i[:, None])
    else:
        tl.store(Lkk + p_d, b_Ld * b_b[:, None], mask=m_i[:, None])
