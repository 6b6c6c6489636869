"""The forward's per-chunk kernels after the solve (steps 3-5 of triton_chunk.py, which launches them; legend
there): `_wu_kernel` (w, u and kg of a chunk), `_scan_kernel` (the state scan over a sequence's chunks, with the
output fused in or the states stored) and `_output_kernel` (the output from stored states).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _chunk_bounds, _f32, _load_lower_blocks, _load_tril, _seq_bounds


@triton.jit
def _load_aqk(p, o_t, m_t, part_stride, PARTS: tl.constexpr):
    """A chunk's Aqk tile [BT, BT] at pointers p (its blocks j <= i; _load_lower_blocks), or with PARTS = 2 the sum
    of the intra kernel's two K halves' partial tiles (fp16, part_stride elements apart), added in fp16 (rounding
    2^-11 of |.| <= 1, below the bf16 rounding that follows; in fp32 the scan takes the same 255 registers and 8
    bytes of spill a thread, ptxas sm_90a). Added by the readers rather than by the solve: the solve's pass over
    both parts and its store of the sum cost 79 us a forward at (8, 4096, 16, 128) on the H200 (kda_tune.py,
    2026-12-01, RESULTS.md session 22). The fused scan's PTX in bf16 converts the sum f16 -> f32 -> bf16 for its dot
    (cvt.f32.f16, cvt.rn.bf16x2.f32 at K = 64, V = 32), as it should."""
    b = _load_lower_blocks(p, o_t, m_t)
    if PARTS == 2:
        b = b + _load_lower_blocks(p + part_stride, o_t, m_t)
    return b


@triton.jit
def _wu_kernel(k, v, beta, Gam, Mm, w, u, kg, q, qg, chunk_indices, cu_seqlens, scale, T, NT, H: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BT: tl.constexpr, STORE_QG: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    scale = _f32(scale)  # fp64 when inductor launches us
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_valid
    # M is lower-triangular: read only j <= i (the blocks the solve wrote)
    b_M = _load_tril(Mm + ((start + o_t[:, None]) * HV + i_hv) * BT + o_t[None, :], o_t, m_t, False)
    b_b = tl.load(beta + (start + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    # K in blocks of BK (a runtime loop: one block's [BT, BK] tiles live at a time; w's columns are independent;
    # one block at K <= 128 with the default BK)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + ((start + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = b_k.to(tl.float32)
        b_G = tl.load(Gam + ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
        p_tk = ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
        # kg = k e^(Gamma_last - Gamma), the keys the state scan adds to the state: computed here, where every chunk
        # is a program of its own, instead of inside the scan's sequential loop (which then loads kg in place of k
        # and the fp32 Gamma tile: 16 KB per step instead of 48 at BT = 64, K = 128, and no exponentials). Stored
        # before the w dot, so that k and Gamma are dead across it
        b_Gl = tl.load(Gam + ((start + n_valid - 1) * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)  # Gamma_last
        tl.store(kg + p_tk, (b_k * tl.exp2(b_Gl[None, :] - b_G)).to(kg.dtype.element_ty), mask=m_tk)
        if STORE_QG:  # the backward's recompute: qg = scale q e^Gamma for its reverse scan, the same way
            b_q = tl.load(q + ((start + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            tl.store(qg + p_tk, (b_q.to(tl.float32) * scale * tl.exp2(b_G)).to(qg.dtype.element_ty), mask=m_tk)
        b_x = (b_k * tl.exp2(b_G) * b_b[:, None]).to(b_M.dtype)
        b_w = tl.dot(b_M, b_x, input_precision=PREC)
        tl.store(w + p_tk, b_w.to(w.dtype.element_ty), mask=m_tk)
    for i_v in tl.static_range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = ((start + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_u = tl.dot(b_M, (b_v * b_b[:, None]).to(b_M.dtype), input_precision=PREC)
        tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _scan_kernel(kg, w, u, Gam, vnew, hbuf, h0, ht, qg, Aqk, o, cu_seqlens, chunk_offsets, T, NT, aqk_stride,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, BT: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                 OUTPUT: tl.constexpr, STORE_STATES: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                 AQK_PARTS: tl.constexpr):
    # OUTPUT (step 5 fused in, LAUNCH["scan"]["OUTPUT_FROM"]): o = qg h + Aqk v_new per chunk from the state in
    # registers; qg = scale q exp2(Gamma) from the intra kernel. STORE_STATES: h[c] and v_new are stored (hbuf,
    # vnew; else unused), for `_output_kernel` (without OUTPUT) or for the backward (a training forward that keeps
    # them: keep_states). AQK_PARTS = 2 (the intra kernel's K split): Aqk holds two partial sums aqk_stride
    # elements apart, added here as loaded (_load_aqk).
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0, n_chunks = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, NT, BT, VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_t = tl.arange(0, BT)
    p_state = ((i_n * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h = tl.load(h0 + p_state, mask=m_kv, other=0.0).to(tl.float32)
    # tl.range, not while: a GPU compile software-pipelines the loop's loads (chunk c + 1's w, u, Gamma, k while chunk
    # c computes) with the launch's num_stages; a while loop never does. (The interpreter needs the numpy >= 2.4 fix
    # of tests/kernels/conftest.py for a range over a runtime scalar.)
    for c in tl.range(0, n_chunks):
        start = bos + c * BT
        n_valid = tl.minimum(eos - start, BT).to(tl.int32)
        m_t = o_t < n_valid
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        if STORE_STATES:
            tl.store(hbuf + (((c0 + c) * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :],
                     b_h.to(hbuf.dtype.element_ty), mask=m_kv)
        p_tk = ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
        p_tv = ((start + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_vn = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)  # v_new = u - w h
        if OUTPUT:  # as `_output_kernel`, with h and v_new rounded to the input dtype as its loads of them are
            b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.0).to(b_w.dtype)
            b_A = _load_aqk(Aqk + ((start + o_t[:, None]) * HV + i_hv) * BT + o_t[None, :], o_t, m_t, aqk_stride,
                            AQK_PARTS).to(b_w.dtype)
            b_o = tl.dot(b_qg, b_h.to(b_w.dtype), input_precision=PREC)
            b_o += tl.dot(b_A, b_vn.to(b_w.dtype), input_precision=PREC)
            tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        if STORE_STATES:
            tl.store(vnew + p_tv, b_vn.to(vnew.dtype.element_ty), mask=m_tv)
        b_Gl = tl.load(Gam + ((start + n_valid - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # Gamma_last
        b_kg = tl.load(kg + p_tk, mask=m_tk, other=0.0).to(b_w.dtype)  # from the w/u kernel; zero rows past the end
        b_h = b_h * tl.exp2(b_Gl)[:, None] + tl.dot(tl.trans(b_kg), b_vn.to(b_w.dtype), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + p_state, b_h.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def _output_kernel(q, Gam, Aqk, vnew, hbuf, o, chunk_indices, cu_seqlens, scale, T, NT, aqk_stride,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                   AQK_PARTS: tl.constexpr):
    # AQK_PARTS as in _scan_kernel
    scale = _f32(scale)  # fp64 when inductor launches us
    i_v, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_valid
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    b_A = _load_aqk(Aqk + ((start + o_t[:, None]) * HV + i_hv) * BT + o_t[None, :], o_t, m_t, aqk_stride,
                    AQK_PARTS).to(vnew.dtype.element_ty)
    b_q = tl.load(q + ((start + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_G = tl.load(Gam + ((start + o_t[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_qg = (b_q.to(tl.float32) * scale * tl.exp2(b_G)).to(b_A.dtype)
    b_h = tl.load(hbuf + ((i_t.to(tl.int64) * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0).to(b_A.dtype)
    p_tv = ((start + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
    b_vn = tl.load(vnew + p_tv, mask=m_tv, other=0.0)
    b_o = tl.dot(b_qg, b_h, input_precision=PREC) + tl.dot(b_A, b_vn, input_precision=PREC)
    tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
