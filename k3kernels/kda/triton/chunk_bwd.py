"""Chunkwise KDA backward as Triton kernels (the backward of `chunk_kda` on the "triton" backend).

Legend as in chunk_fwd.py: T_all total tokens, H q/k heads, HV value heads, K key dim, V value dim, BT chunk size,
BC = 16 sub-chunk, NC = BT / BC, NT_all chunks over all sequences, BK = next_pow2(K), BV value block.
Gamma = chunk-local cumsum(g) (stored in log2 units, so exp(Gamma) = exp2(Gam)); qs = scale * q.

Forward per chunk (kda.md 3.1): Aqk = tril(qs k^T decay), L = diag(beta) Akk (strict), M = (I + L)^-1,
w = M diag(beta) (k e^Gamma), u = M diag(beta) v, v_new = u - w h, o = (qs e^Gamma) h + Aqk v_new,
h' = Diag(e^Gamma_last) h + (k e^(Gamma_last - Gamma))^T v_new.  The backward is the chain rule of these lines
(the same derivation as chunk_torch.py `_ChunkKDA.backward`, at chunk granularity):
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
3. `_bwd_intra_kernel` (intra_bwd.py, as 4), one program per (chunk, 16-token sub-chunk, K block, value
   head): the gradient of Aqk and Akk w.r.t. q, k, Gamma of the sub-chunk's rows: as queries against earlier
   sub-chunks' keys (anchor Gamma_n, the sub-chunk's first row) and as keys against later sub-chunks' queries
   (anchor: its last row), both factors <= 1; the diagonal block with the fixed anchor C (safe gate) or exact
   pairwise exponents. Stores dq, dk, dGamma (with the q / k L2 norm's backward inside where it can be).
4. `_bwd_dg_kernel`, one program per (chunk, K block, value head): dg = reverse cumsum of dGamma inside the chunk.
Inputs from the forward: a training forward (kda/chunk.py's _ChunkKDATriton) saves Gamma (fp32), Aqk, Akk (fp32)
and M, and by default w, v_new, the states, kg and qg; with KernelConfig.kda_recompute those are recomputed from
Gamma and M first (chunk_bwd_triton's `states`), so the backward runs no intra-chunk or solve kernel either way.
All backward arithmetic is fp32; the dots of fp32 inputs run tf32x3 (near fp32 on the tensor cores;
KernelConfig.kda_fp32_dots picks another, common.fp32_dot_precision). For bf16/fp16 inputs the intra kernel's
diagonal (anchored) blocks run 'bf16x3' (three bf16 MMAs, near-fp32 accuracy), as kda.md 3.3 prescribes for the
safe-path backward (HALF_INPUT_PRECISION); every other dot, whose factors are all <= 1, takes LAUNCH[...]["PREC"]:
bf16 in the scan and inter kernels, tf32 in the intra kernel's off-diagonal blocks (fla-core 0.6.0's choices).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import SUB_CHUNK
from .common import (
    RCP_LN2,
    _chunk_bounds,
    _dot,
    _f32,
    _load_lower_blocks,
    _load_tril,
    _seq_bounds,
    chunk_layout,
    device_sms,
    fp32_dot_precision,
    launch_fitting,
    loop_range,
)
from .intra_bwd import _bwd_dg_kernel, _bwd_intra_kernel
from .launch import (
    HALF_INPUT_PRECISION,
    LAUNCH,
    bwd_scan_launch,
    bwd_v_block,
    dot_prec,
    inter_k_block,
    interpreted,
    intra_launch,
    launch_opts,
    partial_dtype,
    q_norm_from_output,
    recompute_dtypes,
)
from .norm import l2norm_bwd_from_y


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
    initial state's gradient dh0 is stored (only with an initial state). At (8, 4096, 16, 128) each would be an
    8 MB fp32 buffer filled or written and thrown away on every backward without states (~3 us each on an H200).
    SPLIT (heads with K > 128: BK = next_pow2(K) / 2 then): the state gradient held as two [BK, BV] K halves,
    each with its own key-side tiles and dots, so that no [BT, 2 BK] operand is staged in shared memory whole. In one
    piece an fp32 reverse scan at K = 256 asks for 233,472 bytes of shared memory at 1 stage, above the H200's
    232,448."""
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
    # reverse over the sequence's chunks; a counted loop (loop_range: tl.range when compiled), not while, so a GPU
    # compile software-pipelines the loads (as in the forward scan, chunk_fwd._scan_kernel)
    for i_c in loop_range(0, n_chunks):
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


def chunk_bwd_triton(q, k, v, beta, h0, Gam, Aqk, Akk, Mm, do, dht, *, scale, safe_shift, chunk_size, cu_seqlens,
                     states, cu_host=None, rstd=None, o=None):
    """Gradients of the chunkwise KDA core from what a training forward saved (kda/chunk.py's _ChunkKDATriton).
    q, k: [B, T, H, K] (unscaled); v: [B, T, HV, V]; beta: [B, T, HV] (any float dtype); h0: [N, HV, K, V] fp32 or None;
    the forward's Gam: [T_all, HV, K] fp32 (log2 units), Aqk: [T_all, HV, BT] (input dtype), Akk: [T_all, HV, BT]
    fp32, Mm: [T_all, HV, BT] (input dtype); do: [B, T, HV, V]; dht: [N, HV, K, V] or None. states: the forward's
    (w, vnew, hbuf, kg, qg) in recompute_dtypes (chunk_fwd_pipeline's keep_states), or a function (h_fp32,
    kq_dtype) -> those that recomputes them (kda/chunk.py's recompute_states), called first; what it returns is
    released as soon as the reverse scan is done with it. cu_host: cu_seqlens as host ints, or None.
    rstd: None, or (rq, rk) [B T H] fp32 when q and k are the outputs of the L2 norm (norm.l2norm_fwd): dq
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
    prec = fp32_dot_precision() if dt == torch.float32 else interpreted(HALF_INPUT_PRECISION)
    # bf16 inputs with bf16 inter dots: the states entering each chunk (hbuf) and the state gradients (dhs) are
    # stored in bf16 (recompute_dtypes); half the bytes of the two [NT_all, HV, K, V] buffers (fla-core 0.6.0 keeps
    # h and dh in bf16 too)
    h_dtype, kq_dtype = recompute_dtypes(dt)
    if callable(states):  # not bound to a name, so that kg and qg go after the reverse scan
        w, vnew, hbuf, kg, qg = states(h_dtype == torch.float32, kq_dtype)
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
                "PREC": dot_prec("bwd_scan", dt), "HAS_DHT": has_dht, "STORE_DH0": dh0 is not None, **scan_opts}
        launch_fitting(_bwd_scan_kernel, (triton.cdiv(V, BVs), N, HV), *scan_args, BK=BK // 2 if split else BK, **scan)
        del kg, qg
        # iprec, not `prec`: that is the intra kernel's diagonal dots
        BVi, iprec = bwd_v_block("bwd_inter", V), dot_prec("bwd_inter", dt)
        _bwd_inter_kernel[(NT_all, HV)](q, k, v, beta, Gam, Akk, Mm, vnew, hbuf, dhs, do, dvn, dv, dAq, dAk, dqs,
                                        dkk, dG, db, chunk_indices, cu, float(scale), T, NT, H=H, HV=HV, K=K, V=V,
                                        BKB=inter_k_block(BK, iprec), BV=BVi, BT=BT, VARLEN=varlen, PREC=iprec,
                                        EARLY=LAUNCH["bwd_inter"]["EARLY_LOADS"], **launch_opts("bwd_inter"))
        shift = 0.0 if safe_shift is None else safe_shift * RCP_LN2
        intra = {"H": H, "HV": HV, "K": K, "BK": BKi, "BT": BT, "BC": BC, "NC": BT // BC,
                 "SAFE": safe_shift is not None, "VARLEN": varlen, "PREC": prec, "OFF": dot_prec("bwd_intra", dt),
                 "NORM": norm_fused, "Q_NORM_OUT": q_norm_out, "V": V, "BV": triton.next_power_of_2(V), **opts}
        rq, rk = rstd if norm_fused or q_norm_out else (dq, dk)  # unused placeholders without NORM
        oo = o.contiguous() if q_norm_out else dq  # (placeholders)
        args = (q, k, Gam, dAq, dAk, dqs, dkk, dG, dq, dk, dg, rq, rk, oo, do if q_norm_out else dq, chunk_indices,
                cu, float(scale), shift, T, NT)
        _bwd_intra_kernel[(NT_all * (BT // BC) * triton.cdiv(K, BKi), HV)](*args, **intra)
        BKg = max(16, min(BK, LAUNCH["bwd_dg"]["BK"]))
        _bwd_dg_kernel[(NT_all * triton.cdiv(K, BKg), HV)](dg, chunk_indices, cu, T, NT, HV=HV, K=K, BK=BKg, BT=BT,
                                                           VARLEN=varlen, **launch_opts("bwd_dg"))
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
