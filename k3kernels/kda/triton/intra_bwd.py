"""The backward's intra-chunk kernels (kernels 3 and 4 of chunk_bwd.py, which launches them; legend there):
`_bwd_intra_kernel`, the gradient of Aqk and Akk w.r.t. q, k and Gamma of a sub-chunk's rows (with the q / k L2
norm's backward inside it where it can be), and `_bwd_dg_kernel`, dg = the in-chunk reverse cumsum of dGamma.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_bounds, _dot, _f32, loop_range


@triton.jit
def _bwd_intra_kernel(q, k, Gam, dAq, dAk, dqs, dkk, dG, dq_out, dk_out, dG_out, rq, rk, o, do, chunk_indices,
                      cu_seqlens, scale, shift, T, NT, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      NC: tl.constexpr, SAFE: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                      OFF: tl.constexpr, NORM: tl.constexpr, Q_NORM_OUT: tl.constexpr):
    scale, shift = _f32(scale), _f32(shift)  # fp64 when inductor launches us
    # one program per (chunk, sub-chunk i, K block of BK columns, value head), those of a chunk adjacent in launch
    # order (they read the same dAq / dAk rows). Output columns k read only column k of q, k, Gamma, dqs, dkk, dG (the
    # dots contract over time), so K blocks are independent; and the program owns its BC rows' outputs: their row
    # terms (as the query side of Aqk / Akk: keys of sub-chunks j <= i) and column terms (as the key side: queries of
    # sub-chunks j >= i). [BC, BK] tiles only: few registers, NC x the programs of one per chunk.
    NKB: tl.constexpr = (K + BK - 1) // BK
    pid = tl.program_id(0)
    i_t, i_i, i_kb, i_hv = pid // (NC * NKB), (pid // NKB) % NC, pid % NKB, tl.program_id(1)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    if i_i * BC >= n_valid:  # a sub-chunk past the end of a partial chunk: no rows
        return
    b_dG, p_ik, m_ik = _bwd_intra_rows(q, k, Gam, dAq, dAk, dqs, dkk, dG, dq_out, dk_out, rq, rk, o, do, start,
                                       n_valid, i_i, i_kb, i_hv, scale, shift, H, HV, K, V, BK, BV, BT, BC, SAFE,
                                       PREC, OFF, NORM, Q_NORM_OUT)
    tl.store(dG_out + p_ik, b_dG, mask=m_ik)


@triton.jit
def _bwd_intra_rows(q, k, Gam, dAq, dAk, dqs, dkk, dG, dq_out, dk_out, rq, rk, o, do, start, n_valid, i_i, i_kb, i_hv,
                    scale, shift, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SAFE: tl.constexpr,
                    PREC: tl.constexpr, OFF: tl.constexpr, NORM: tl.constexpr, Q_NORM_OUT: tl.constexpr):
    """The backward intra step for the BC rows of sub-chunk i_i (which must start before the chunk's n_valid rows
    end) and K block i_kb of one chunk and value head: stores their dq and dk (NORM: those of the q / k L2 norm's
    input, from q, k as its output and the rows' rstd rq, rk [T_all * H]; needs one K block. Q_NORM_OUT: q's alone,
    with any K block, its row sum from the output: o_t = scale S_t^T q_t is linear in the normalized q_t (S_t
    depends on k, v, g, beta only), so sum(dq_t q_t) = sum(do_t o_t), from o, do [T_all, HV, V] (BV = next_pow2(V)),
    where the K blocks' partial sums would need each other; k stays the caller's pass); returns dGamma
    [BC, BK] fp32 (before the in-chunk reverse cumsum; 0 in masked rows) and the rows' pointers and mask into
    [T_all, HV, K]."""
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, BC)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    r_i = i_i * BC + o_c  # this sub-chunk's rows, in the chunk
    m_i = r_i < n_valid
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = ((start + r_i[:, None]) * HV + i_hv) * K + o_k[None, :]
    p_iq = ((start + r_i[:, None]) * H + i_h) * K + o_k[None, :]
    if Q_NORM_OUT:  # sum(do o) of these rows [BC], loaded first: nothing else waits on it
        o_v = tl.arange(0, BV)
        m_iv = m_i[:, None] & (o_v < V)[None, :]
        p_iv = ((start + r_i[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_s = tl.sum(tl.load(o + p_iv, mask=m_iv, other=0.0).to(tl.float32)
                     * tl.load(do + p_iv, mask=m_iv, other=0.0).to(tl.float32), axis=1)
    b_q = tl.load(q + p_iq, mask=m_ik, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + p_iq, mask=m_ik, other=0.0).to(tl.float32)
    b_G = tl.load(Gam + p_ik, mask=m_ik, other=0.0)
    b_Gn = tl.load(Gam + ((start + i_i * BC) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # first row: the anchor
    p_rows = ((start + r_i[:, None]) * HV + i_hv) * BT  # row r_i of dAq / dAk
    # row terms, keys of earlier sub-chunks j < i: anchor Gamma_n, both factors <= 1
    b_dqr = tl.zeros([BC, BK], dtype=tl.float32)  # d(qs) of these rows
    b_dkr = tl.zeros([BC, BK], dtype=tl.float32)  # dk of these rows as the query side of Akk
    for jb in loop_range(0, i_i):
        r_j = jb * BC + o_c
        p_jk = ((start + r_j[:, None]) * HV + i_hv) * K + o_k[None, :]
        p_jq = ((start + r_j[:, None]) * H + i_h) * K + o_k[None, :]
        b_kc = (tl.load(k + p_jq, mask=m_k[None, :], other=0.0).to(tl.float32)
                * tl.exp2(b_Gn[None, :] - tl.load(Gam + p_jk, mask=m_k[None, :], other=0.0)))
        b_dqr += _dot(tl.load(dAq + p_rows + r_j[None, :], mask=m_i[:, None], other=0.0), b_kc, OFF)
        b_dkr += _dot(tl.load(dAk + p_rows + r_j[None, :], mask=m_i[:, None], other=0.0), b_kc, OFF)
    e_q = tl.exp2(tl.where(m_ik, b_G - b_Gn[None, :], float("-inf")))
    b_dqr *= e_q
    b_dkr *= e_q
    # the diagonal block: dAq zero above the diagonal, dAk on and above it (as stored); rows past n_valid masked
    m_d = m_i[:, None] & m_i[None, :]
    b_dAq_d = tl.load(dAq + p_rows + r_i[None, :], mask=m_d, other=0.0)
    b_dAk_d = tl.load(dAk + p_rows + r_i[None, :], mask=m_d, other=0.0)
    if SAFE:  # fixed anchor C = Gamma_n - shift, as in the forward
        b_C = b_Gn - shift
        # rf = exp2(Gamma_i - C) = e_q exp2(shift), and below exp2(Gamma_a - Gamma_i) = cf exp2(Gamma_a - C): two
        # multiplies in place of two tiles of exponentials, as in the forward's intra kernel. PTX (sm_90a, 1 warp,
        # K block 32): 66 ex2 against 96; 1,447 against 1,468 us at (8, 4096, 16, 128) on an H200
        rf = e_q * tl.exp2(shift)
        cf = tl.exp2(tl.where(m_ik, b_C[None, :] - b_G, float("-inf")))
        b_kcf = b_k * cf
        b_dqr += rf * _dot(b_dAq_d, b_kcf, PREC)
        b_dkr += rf * _dot(b_dAk_d, b_kcf, PREC)
        b_dc = cf * (_dot(tl.trans(b_dAq_d), b_q * rf, PREC) + _dot(tl.trans(b_dAk_d), b_k * rf, PREC))
    else:  # exact pairwise exponents, one key column j at a time
        cf = e_q  # (defined on both paths for the compiler; unused)
        b_dc = tl.zeros([BC, BK], dtype=tl.float32)
        for j in tl.static_range(BC):
            sel = o_c[:, None] == j
            b_kj = tl.sum(tl.where(sel, b_k, 0.0), axis=0)  # [BK]
            b_Gj = tl.sum(tl.where(sel, b_G, 0.0), axis=0)
            e = tl.exp2(tl.where((o_c[:, None] >= j) & m_ik, b_G - b_Gj[None, :], float("-inf")))  # [BC, BK]
            a_q = tl.sum(tl.where(o_c[None, :] == j, b_dAq_d, 0.0), axis=1)  # column j of dAq [BC]
            a_k = tl.sum(tl.where(o_c[None, :] == j, b_dAk_d, 0.0), axis=1)
            b_dqr += a_q[:, None] * b_kj[None, :] * e
            b_dkr += a_k[:, None] * b_kj[None, :] * e
            col = tl.sum((a_q[:, None] * b_q + a_k[:, None] * b_k) * e, axis=0)  # [BK]
            b_dc += tl.where(sel, col[None, :], 0.0)
    # column terms, queries of later sub-chunks j > i: anchor Gamma_a at this sub-chunk's last row (full, since a
    # later one exists), so exp2(Gamma_j - Gamma_a) <= 1 and exp2(Gamma_a - Gamma_i) <= 1
    b_dco = tl.zeros([BC, BK], dtype=tl.float32)
    n_sub = tl.cdiv(n_valid, BC)
    if i_i + 1 < n_sub:
        b_Ga = tl.load(Gam + ((start + i_i * BC + BC - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
        for jq in loop_range(i_i + 1, n_sub):  # not `j`: the diagonal's static_range left j a constexpr
            r_j = jq * BC + o_c
            m_j = r_j < n_valid
            m_jk = m_j[:, None] & m_k[None, :]
            p_jk = ((start + r_j[:, None]) * HV + i_hv) * K + o_k[None, :]
            p_jq = ((start + r_j[:, None]) * H + i_h) * K + o_k[None, :]
            e_j = tl.exp2(tl.where(m_jk, tl.load(Gam + p_jk, mask=m_jk, other=0.0) - b_Ga[None, :], float("-inf")))
            p_dA = ((start + r_j[:, None]) * HV + i_hv) * BT + r_i[None, :]  # [BC_j, BC_i] of dAq / dAk
            b_dAq_j = tl.load(dAq + p_dA, mask=m_j[:, None], other=0.0)
            b_dAk_j = tl.load(dAk + p_dA, mask=m_j[:, None], other=0.0)
            b_qe = tl.load(q + p_jq, mask=m_jk, other=0.0).to(tl.float32) * scale * e_j
            b_ke = tl.load(k + p_jq, mask=m_jk, other=0.0).to(tl.float32) * e_j
            b_dco += _dot(tl.trans(b_dAq_j), b_qe, OFF) + _dot(tl.trans(b_dAk_j), b_ke, OFF)
        if SAFE:  # exp2(Gamma_a - Gamma_i) = exp2(C - Gamma_i) exp2(Gamma_a - C): cf times one row of exponentials
            b_dco *= cf * tl.exp2(b_Ga - b_Gn + shift)[None, :]
        else:
            b_dco *= tl.exp2(tl.where(m_ik, b_Ga[None, :] - b_G, float("-inf")))
    b_dc += b_dco
    b_dq = (tl.load(dqs + p_ik, mask=m_ik, other=0.0).to(tl.float32) + b_dqr) * scale
    b_dk = tl.load(dkk + p_ik, mask=m_ik, other=0.0).to(tl.float32) + b_dkr + b_dc
    if NORM:  # the q / k L2 norm's backward, dx = r (dy - y sum(dy y)): q, k are its y; this block holds all K
        b_yq = b_q * (1.0 / scale)  # the loaded q (b_q is scaled)
        b_dq = tl.load(rq + (start + r_i) * H + i_h, mask=m_i, other=0.0)[:, None] * (
            b_dq - b_yq * tl.sum(b_dq * b_yq, axis=1)[:, None])
        b_dk = tl.load(rk + (start + r_i) * H + i_h, mask=m_i, other=0.0)[:, None] * (
            b_dk - b_k * tl.sum(b_dk * b_k, axis=1)[:, None])
    elif Q_NORM_OUT:
        b_dq = tl.load(rq + (start + r_i) * H + i_h, mask=m_i, other=0.0)[:, None] * (
            b_dq - b_q * (1.0 / scale) * b_s[:, None])
    tl.store(dq_out + p_ik, b_dq.to(dq_out.dtype.element_ty), mask=m_ik)
    tl.store(dk_out + p_ik, b_dk.to(dk_out.dtype.element_ty), mask=m_ik)
    # Gamma_i enters with + (rows: query side of q and k), Gamma_j with - (columns: key side)
    b_dG = tl.load(dG + p_ik, mask=m_ik, other=0.0) + b_q * b_dqr + b_k * (b_dkr - b_dc)
    return b_dG, p_ik, m_ik


@triton.jit
def _bwd_dg_kernel(dG, chunk_indices, cu_seqlens, T, NT, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   BT: tl.constexpr, VARLEN: tl.constexpr):
    """In place: dg = reverse cumsum of dGamma inside each chunk (Gamma = inclusive cumsum of g there, so dg_t =
    sum_{t' >= t} dGamma_t'). One program per (chunk, K block, value head)."""
    NKB: tl.constexpr = (K + BK - 1) // BK
    i_t, i_kb, i_hv = tl.program_id(0) // NKB, tl.program_id(0) % NKB, tl.program_id(1)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_tk = (o_t < n_valid)[:, None] & (o_k < K)[None, :]
    p = ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
    b = tl.load(dG + p, mask=m_tk, other=0.0)
    tl.store(dG + p, tl.sum(b, axis=0)[None, :] - tl.cumsum(b, axis=0) + b, mask=m_tk)
