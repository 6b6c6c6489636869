"""The forward's step 2 as a Triton kernel (chunk_fwd.py): M = (I + L)^-1 per chunk, L = diag(beta) k k^T with
decay, strictly lower-triangular [BT, BT] (kda.md 3.2 step 2b), stored in the input dtype for the w/u kernel and the
backward. One program per (chunk, value head); Lkk, Mout: [T_all, HV, BT]. Legend as in chunk_fwd.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_bounds


@triton.jit
def _inv_unit_lower(b_L, beta, start, n_valid, i_hv, HV: tl.constexpr, NC: tl.constexpr, BC: tl.constexpr,
                    BETA: tl.constexpr):
    """(I + L_b)^-1 of NC strictly lower-triangular [BC, BC] blocks at once (b_L [NC, BC, BC]) by fp32 forward
    substitution, row by row: all NC blocks in one walk of BC - 1 row steps. With BETA, b_L holds Akk and L = diag(beta)
    Akk: each row step's sum is scaled by that row's beta (loaded per step, [NC])."""
    o_r = tl.arange(0, BC)[None, :, None]
    o_c = tl.arange(0, BC)[None, None, :]
    o_b = tl.arange(0, NC) * BC
    b_M = tl.where(o_r == o_c, 1.0, 0.0) + tl.zeros([NC, BC, BC], dtype=tl.float32)
    for i in tl.static_range(1, BC):
        b_l = tl.sum(tl.where(o_r == i, b_L, 0.0), axis=1)  # row i of each L [NC, BC] (zero from column i on)
        b_row = tl.sum(b_l[:, :, None] * b_M, axis=1)  # sum_{j < i} L_ij M_j [NC, BC]
        if BETA:
            b_beta = tl.load(beta + (start + o_b + i) * HV + i_hv, mask=o_b + i < n_valid, other=0.0)
            b_row *= b_beta.to(tl.float32)[:, None]
        b_M = tl.where(o_r == i, b_M - b_row[:, None, :], b_M)
    return b_M


@triton.jit
def _pick(b_X, b: tl.constexpr, NC: tl.constexpr):
    """Block b [BC, BC] of b_X [NC, BC, BC]."""
    return tl.sum(tl.where(tl.arange(0, NC)[:, None, None] == b, b_X, 0.0), axis=0)


@triton.jit
def _times_beta(x, beta, start, n_valid, i_hv, r: tl.constexpr, HV: tl.constexpr, BC: tl.constexpr,
                BETA: tl.constexpr):
    """x [BC, BC], a sum over block row r's Akk blocks, times that row's beta (L = diag(beta) Akk) with BETA; rows
    past the sequence end get 0. Applied to the sums (in the dots' output layout) rather than to the loaded blocks:
    a product between the load and the dot made Triton convert each block's layout (ptxas, sm_90a, 1 warp: 3,861
    PTX instructions, 914 shuffles, 128 registers against 2,541, 396 and 102 without beta; 2,949, 396 and 133 in
    this form). H200, training solve: 80 against 95 us at (8, 4096, 16, 128), 151 against 183 at (16, 2048, 32, 64)."""
    if BETA:
        rows = r * BC + tl.arange(0, BC)
        x = x * tl.load(beta + (start + rows) * HV + i_hv, mask=rows < n_valid, other=0.0).to(tl.float32)[:, None]
    return x


@triton.jit
def _load_block(Lkk, start, n_valid, i_hv, r: tl.constexpr, c: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, part_stride, PARTS: tl.constexpr):
    """Block (r, c) [BC, BC] of the chunk's L (or Akk), the sum of its PARTS partial sums; rows past the sequence
    end read as 0."""
    o_c = tl.arange(0, BC)
    m_r = (r * BC + o_c) < n_valid
    p = ((start + r * BC + o_c[:, None]) * HV + i_hv) * BT + c * BC + o_c[None, :]
    b = tl.load(Lkk + p, mask=m_r[:, None], other=0.0).to(tl.float32)
    if PARTS == 2:
        b += tl.load(Lkk + part_stride + p, mask=m_r[:, None], other=0.0).to(tl.float32)
    return b


@triton.jit
def _store_block(Mout, b_M, start, n_valid, i_hv, r: tl.constexpr, c: tl.constexpr, HV: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr):
    o_c = tl.arange(0, BC)
    m = ((r * BC + o_c) < n_valid)[:, None]
    p = ((start + r * BC + o_c[:, None]) * HV + i_hv) * BT + c * BC + o_c[None, :]
    tl.store(Mout + p, b_M.to(Mout.dtype.element_ty), mask=m)


@triton.jit
def _solve_kernel(Lkk, beta, Mout, chunk_indices, cu_seqlens, T, NT, part_stride, HV: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, NC: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr,
                  PREC: tl.constexpr, PARTS: tl.constexpr):
    """M = (I + L)^-1 of one chunk: the NC diagonal blocks as one [NC, BC, BC] tile (one load, one substitution walk
    of BC - 1 row steps for all of them, one store), then the block-inverse merges M_ij = -M_ii sum_{j <= m < i}
    L_im M_mj. H200, (8, 4096, 16, 128), 1 warp: 65 us per forward against 163 with the four diagonal blocks
    inverted one after another (102 against 168 registers). Lkk: L itself, or with BETA
    Akk = k k^T with decay (a training forward's intra kernel writes that one buffer), whose rows the solve scales
    by beta [T_all, HV]: the row sums of the substitution and the merges (_times_beta). Only the blocks j <= i are
    read. The beta scaling stays on the row sums: scaling the diagonal blocks' rows once as loaded, so that the
    walk loads nothing (133 -> 109 registers), makes the training solve 178 us against 149 at (16, 2048, 32, 64), 92
    against 78 at (8, 4096, 16, 128) on an H200.
    PARTS = 2 (the intra kernel's K split): Lkk holds two partial sums part_stride elements apart, added as loaded
    (Aqk's two are added by its readers: chunk_fwd._load_aqk)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_b = tl.arange(0, NC)[:, None, None]
    rows = o_b * BC + tl.arange(0, BC)[None, :, None]
    p_d = ((start + rows) * HV + i_hv) * BT + o_b * BC + tl.arange(0, BC)[None, None, :]
    b_Ld = tl.load(Lkk + p_d, mask=rows < n_valid, other=0.0).to(tl.float32)  # L in fp32, or fp16 (l_fp16)
    if PARTS == 2:
        b_Ld += tl.load(Lkk + part_stride + p_d, mask=rows < n_valid, other=0.0).to(tl.float32)
    b_Md = _inv_unit_lower(b_Ld, beta, start, n_valid, i_hv, HV, NC, BC, BETA)
    tl.store(Mout + p_d, b_Md.to(Mout.dtype.element_ty), mask=rows < n_valid)
    M00 = _pick(b_Md, 0, NC)
    if NC > 1:  # M_ij = -M_ii (beta_i * sum_m Akk_im M_mj) with BETA, else -M_ii sum_m L_im M_mj
        L10 = _load_block(Lkk, start, n_valid, i_hv, 1, 0, HV, BT, BC, part_stride, PARTS)
        M11 = _pick(b_Md, 1, NC)
        R10 = _times_beta(tl.dot(L10, M00, input_precision=PREC), beta, start, n_valid, i_hv, 1, HV, BC, BETA)
        M10 = -tl.dot(M11, R10, input_precision=PREC)
        _store_block(Mout, M10, start, n_valid, i_hv, 1, 0, HV, BT, BC)
    if NC > 2:
        L20 = _load_block(Lkk, start, n_valid, i_hv, 2, 0, HV, BT, BC, part_stride, PARTS)
        L21 = _load_block(Lkk, start, n_valid, i_hv, 2, 1, HV, BT, BC, part_stride, PARTS)
        L30 = _load_block(Lkk, start, n_valid, i_hv, 3, 0, HV, BT, BC, part_stride, PARTS)
        L31 = _load_block(Lkk, start, n_valid, i_hv, 3, 1, HV, BT, BC, part_stride, PARTS)
        L32 = _load_block(Lkk, start, n_valid, i_hv, 3, 2, HV, BT, BC, part_stride, PARTS)
        M22 = _pick(b_Md, 2, NC)
        M33 = _pick(b_Md, 3, NC)
        R21 = _times_beta(tl.dot(L21, M11, input_precision=PREC), beta, start, n_valid, i_hv, 2, HV, BC, BETA)
        M21 = -tl.dot(M22, R21, input_precision=PREC)
        R20 = _times_beta(tl.dot(L20, M00, input_precision=PREC) + tl.dot(L21, M10, input_precision=PREC), beta,
                          start, n_valid, i_hv, 2, HV, BC, BETA)
        M20 = -tl.dot(M22, R20, input_precision=PREC)
        R32 = _times_beta(tl.dot(L32, M22, input_precision=PREC), beta, start, n_valid, i_hv, 3, HV, BC, BETA)
        M32 = -tl.dot(M33, R32, input_precision=PREC)
        R31 = _times_beta(tl.dot(L31, M11, input_precision=PREC) + tl.dot(L32, M21, input_precision=PREC), beta,
                          start, n_valid, i_hv, 3, HV, BC, BETA)
        M31 = -tl.dot(M33, R31, input_precision=PREC)
        R30 = _times_beta(tl.dot(L30, M00, input_precision=PREC) + tl.dot(L31, M10, input_precision=PREC)
                          + tl.dot(L32, M20, input_precision=PREC), beta, start, n_valid, i_hv, 3, HV, BC, BETA)
        M30 = -tl.dot(M33, R30, input_precision=PREC)
        _store_block(Mout, M21, start, n_valid, i_hv, 2, 1, HV, BT, BC)
        _store_block(Mout, M20, start, n_valid, i_hv, 2, 0, HV, BT, BC)
        _store_block(Mout, M32, start, n_valid, i_hv, 3, 2, HV, BT, BC)
        _store_block(Mout, M31, start, n_valid, i_hv, 3, 1, HV, BT, BC)
        _store_block(Mout, M30, start, n_valid, i_hv, 3, 0, HV, BT, BC)
