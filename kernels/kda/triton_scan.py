"""The forward state scan with the state held in two K halves (triton_chunk.py, step 4): an opt-in variant of
`_scan_kernel` (LAUNCH["scan"]["HALVES"], off; untimed). Legend as in triton_chunk.py.

`_scan_kernel` keeps the state entering a chunk as one [BK, BV] fp32 tile and transposes the [BT, BK] keys in
registers for the update dot. This variant, for 64 < K <= 128 only (BK = 128), keeps the state as two [64, BV]
tiles (rows 0..63 and 64..127 of K): each product is two [BT, 64] x [64, BV] dots (v_new = u - w h accumulates
them), and the update reads kg as [64, BT] tiles straight from memory, so nothing is transposed in registers. fla-core
0.6.0's forward state kernel (`chunk_gated_delta_rule_fwd_kernel_h_blockdim64`) holds its state in 64-row tiles too
and ran at 246 us against `_scan_kernel`'s 298 at (8, 4096, 16, 128) on the H200 (Nsight Compute, RESULTS.md session
9), with 158 registers against 216. Same inputs, outputs and masking as `_scan_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _seq_bounds


@triton.jit
def _halves(i_n, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """The two K halves of a state scan's [128, BV] tile (this module's kernel and the backward's
    `_bwd_scan_halves_kernel`): rows o_a = 0..63 and o_b = 64..127 (masked past K), columns o_v of V block i_v;
    returns (o_a, o_b, m_b, o_v, m_v, the halves' masks m_av, m_bv and their offsets p_sa, p_sb into a
    [N, HV, K, V] state for sequence i_n and value head i_hv)."""
    o_a = tl.arange(0, 64)
    o_b = 64 + o_a
    m_b = o_b < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_av = (o_a < K)[:, None] & m_v[None, :]
    m_bv = m_b[:, None] & m_v[None, :]
    p_sa = ((i_n * HV + i_hv) * K + o_a[:, None]) * V + o_v[None, :]
    p_sb = ((i_n * HV + i_hv) * K + o_b[:, None]) * V + o_v[None, :]
    return o_a, o_b, m_b, o_v, m_v, m_av, m_bv, p_sa, p_sb


@triton.jit
def _scan_halves_kernel(kg, w, u, Gam, vnew, hbuf, h0, ht, cu_seqlens, chunk_offsets, T, NT,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                        BT: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, VARLEN: tl.constexpr,
                        PREC: tl.constexpr):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, n_chunks = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, NT, BT, VARLEN)
    o_a, o_b, m_b, o_v, m_v, m_av, m_bv, p_sa, p_sb = _halves(i_n, i_hv, i_v, HV, K, V, BV)
    o_t = tl.arange(0, BT)
    b_ha = tl.zeros([64, BV], dtype=tl.float32)
    b_hb = tl.zeros([64, BV], dtype=tl.float32)
    if HAS_H0:
        b_ha = tl.load(h0 + p_sa, mask=m_av, other=0.0).to(tl.float32)
        b_hb = tl.load(h0 + p_sb, mask=m_bv, other=0.0).to(tl.float32)
    for c in tl.range(0, n_chunks):
        start = bos + c * BT
        n_valid = tl.minimum(eos - start, BT).to(tl.int32)
        m_t = o_t < n_valid
        m_tv = m_t[:, None] & m_v[None, :]
        p_hc = ((c0 + c) * HV + i_hv) * K  # row 0 of the state entering chunk c in hbuf
        tl.store(hbuf + (p_hc + o_a[:, None]) * V + o_v[None, :], b_ha.to(hbuf.dtype.element_ty), mask=m_av)
        tl.store(hbuf + (p_hc + o_b[:, None]) * V + o_v[None, :], b_hb.to(hbuf.dtype.element_ty), mask=m_bv)
        row = ((start + o_t) * HV + i_hv) * K  # [BT]: row t of w / kg / Gamma
        b_wa = tl.load(w + row[:, None] + o_a[None, :], mask=m_t[:, None], other=0.0)
        b_wb = tl.load(w + row[:, None] + o_b[None, :], mask=m_t[:, None] & m_b[None, :], other=0.0)
        b_wh = tl.dot(b_wa, b_ha.to(b_wa.dtype), input_precision=PREC)
        b_wh = tl.dot(b_wb, b_hb.to(b_wb.dtype), b_wh, input_precision=PREC)
        p_tv = ((start + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_vn = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32) - b_wh  # v_new = u - w h
        tl.store(vnew + p_tv, b_vn.to(vnew.dtype.element_ty), mask=m_tv)
        b_vn = b_vn.to(b_wa.dtype)
        p_last = ((start + n_valid - 1) * HV + i_hv) * K  # Gamma_last
        b_gla = tl.exp2(tl.load(Gam + p_last + o_a))
        b_glb = tl.exp2(tl.load(Gam + p_last + o_b, mask=m_b, other=0.0))
        # kg as [64, BT] (K rows, time columns) from the w/u kernel; zero columns past the end
        b_ka = tl.load(kg + row[None, :] + o_a[:, None], mask=m_t[None, :], other=0.0).to(b_wa.dtype)
        b_kb = tl.load(kg + row[None, :] + o_b[:, None], mask=m_b[:, None] & m_t[None, :], other=0.0).to(b_wa.dtype)
        b_ha = tl.dot(b_ka, b_vn, b_ha * b_gla[:, None], input_precision=PREC)
        b_hb = tl.dot(b_kb, b_vn, b_hb * b_glb[:, None], input_precision=PREC)
    if STORE_HT:
        tl.store(ht + p_sa, b_ha.to(ht.dtype.element_ty), mask=m_av)
        tl.store(ht + p_sb, b_hb.to(ht.dtype.element_ty), mask=m_bv)
