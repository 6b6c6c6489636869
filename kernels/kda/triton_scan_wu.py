"""The forward's steps 3 and 4 in one kernel (triton_chunk.py): the state scan computes each chunk's w, u and kg itself
from k, v, beta, Gamma and M, instead of loading what `_wu_kernel` stored. Experimental, off by default
(triton_chunk.LAUNCH["scan"]["FUSE_WU"]); untimed on a GPU when written (RESULTS.md session 13).

Why: the w/u kernel writes w, u and kg (3 x 2 bytes per token, value head and K or V column in bf16) only for the scan
to read them back once: ~1.5 KB per token and head at K = V = 128, ~0.8 GB at (8, 4096, 16, 128), and a 311 us kernel
on the H200. At few sequences the scan runs one program per multiprocessor or fewer (128 programs at
(2, 16384, 16, 128)), so its multiprocessors have room for the w/u dots. The cost: each V-block program recomputes its
chunk's w and kg, and the fp32 Gamma tile is loaded in the sequential loop.

Legend as in triton_chunk.py. One program per (V block, sequence, value head), walking the sequence's chunks:
    w = M (beta k e^Gamma), u = M (beta v), kg = k e^(Gamma_last - Gamma)     (rounded to the input dtype, as stored)
    v_new = u - w h;  [o = qg h + Aqk v_new];  h <- Diag(e^Gamma_last) h + kg^T v_new
With STORE_WU (a training forward that keeps its states for the backward) the program of V block 0 stores w and kg
and every program its block of u, as `_wu_kernel` would have; the values are the same roundings of the same products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _scan_chunk, _scan_init, _scan_out


@triton.jit
def _scan_wu_kernel(k, v, beta, Gam, Mm, w, u, kg, vnew, hbuf, h0, ht, qg, Aqk, o, cu_seqlens, chunk_offsets, T, NT,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, BT: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                    OUTPUT: tl.constexpr, STORE_STATES: tl.constexpr, STORE_WU: tl.constexpr, VARLEN: tl.constexpr,
                    PREC: tl.constexpr):
    i_v, i_hv = tl.program_id(0), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, eos, c0, n_chunks, o_k, o_v, b_h, p_state = _scan_init(h0, cu_seqlens, chunk_offsets, T, NT, HV, K, V, BK,
                                                                 BV, BT, HAS_H0, VARLEN)
    m_k = o_k < K
    o_t = tl.arange(0, BT)
    for c in tl.range(0, n_chunks):
        start, n_valid, m_t, m_tk, m_tv, p_tk, p_tv = _scan_chunk(c, bos, eos, c0, b_h, hbuf, i_hv, o_k, o_v, HV, K,
                                                                  V, BT, STORE_STATES)
        # step 3 for this chunk, as _wu_kernel computes it (M read only where j <= i)
        b_M = tl.load(Mm + ((start + o_t[:, None]) * HV + i_hv) * BT + o_t[None, :],
                      mask=m_t[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.0)
        b_b = tl.load(beta + (start + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_k = tl.load(k + ((start + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_G = tl.load(Gam + p_tk, mask=m_tk, other=0.0)
        b_Gl = tl.load(Gam + ((start + n_valid - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # Gamma_last
        b_kg = (b_k * tl.exp2(b_Gl[None, :] - b_G)).to(kg.dtype.element_ty)
        b_w = tl.dot(b_M, (b_k * tl.exp2(b_G) * b_b[:, None]).to(b_M.dtype), input_precision=PREC)
        b_w = b_w.to(w.dtype.element_ty)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_u = tl.dot(b_M, (b_v * b_b[:, None]).to(b_M.dtype), input_precision=PREC).to(u.dtype.element_ty)
        if STORE_WU:
            tl.store(u + p_tv, b_u, mask=m_tv)
            if i_v == 0:
                tl.store(w + p_tk, b_w, mask=m_tk)
                tl.store(kg + p_tk, b_kg, mask=m_tk)
        # step 4, as _scan_kernel
        b_vn = _scan_out(b_h, b_w, b_u.to(tl.float32), qg, Aqk, o, vnew, start, m_t, i_hv, p_tk, p_tv, m_tk, m_tv, HV,
                         BT, OUTPUT, STORE_STATES, PREC)
        b_h = b_h * tl.exp2(b_Gl)[:, None] + tl.dot(tl.trans(b_kg.to(b_w.dtype)), b_vn.to(b_w.dtype),
                                                     input_precision=PREC)
    if STORE_HT:
        tl.store(ht + p_state, b_h.to(ht.dtype.element_ty), mask=m_k[:, None] & (o_v < V)[None, :])
