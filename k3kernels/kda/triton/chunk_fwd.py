"""Chunkwise KDA forward as Triton kernels: the launchers (`chunk_fwd_pipeline`, `chunk_fwd_states`) and the w/u,
state scan and output kernels. kda/chunk.py's autograd Function runs them; the backward is chunk_bwd.py.

Legend: N sequences, T_all total tokens (B * T, or the packed varlen length), H q/k heads, HV value heads, K key dim,
V value dim, BT chunk size (16/32/64), BC = 16 sub-chunk, NC = BT / BC, NT_all chunks over all sequences,
BK = next_pow2(K), BV value block. Every tensor is addressed as [T_all, heads, dim] (B folded into T).

Pipeline (kda.md section 3.2; equations of section 3.1 in log2 units, Gamma = chunk-local cumsum(g) / ln 2):
1. `_intra_sub_kernel` (intra_fwd.py), one program per (chunk, 16-token sub-chunk s, value head), the whole K
   at once: Gamma [T_all, HV, K] fp32 (one walk over the earlier sub-chunks' g gives their decay to the anchor and
   the carry into s); the rows of sub-chunk s of Aqk = scale * q k^T with decay (j <= i) and of L = diag(beta) k k^T
   with decay (j < i), both [T_all, HV, BT]:
     off-diagonal (columns of earlier sub-chunks): one dot with the anchor Gamma_n = first row of sub-chunk s,
       query factor exp2(Gamma_i - Gamma_n) <= 1, key factor exp2(Gamma_n - Gamma_j) <= 1 (kda.md 3.3);
     diagonal 16 x 16 block: with `safe_gate` one dot with the fixed anchor C = Gamma_n - (BC - 1) s / 2 (in log2
       units), s = -lower_bound (2 if unset), so appending tokens cannot move C; otherwise exact pairwise exponents,
       one column at a time in fp32 (any g, including -1000).
   One program per sub-chunk: one per (chunk, head) over all sub-chunks took 1,003-1,046 us against 800 at
   (8, 4096, 16, 128) on an H200, whichever way it held Gamma.
2. `_solve_kernel` (solve.py): M = (I + L)^-1 by fp32 forward substitution on the diagonal 16 x 16 blocks
   (all of a chunk's at once) and block-inverse merges M_ij = -M_ii sum_{j <= m < i} L_im M_mj (kda.md 3.2 step 2b).
3. `_wu_kernel`: w = M (beta k exp2(Gamma)), u = M (beta v), and kg = k exp2(Gamma_last - Gamma) for the scan (in
   the backward's recompute also qg = scale q exp2(Gamma) for the reverse scan).
4. `_scan_kernel`, one program per (V block, sequence, value head), sequential over the sequence's chunks:
   h[c] = state entering chunk c; v_new = u - w h; h <- Diag(exp2(Gamma_last)) h + kg^T v_new. With fewer
   programs than multiprocessors and long sequences, steps 3 and 4 run in time segments, the w/u kernel of the next
   segment during the scan of this one (LAUNCH["scan"]["SEGMENT_CHUNKS"], segments.py).
5. `_output_kernel`: o = (scale q exp2(Gamma)) h[c] + Aqk v_new. Or, when the scan runs enough programs
   (fuse_output; not with return_intermediate_states), inside the scan's loop from the state in registers: the
   intra kernel stores qg = scale q exp2(Gamma), and neither h[c] nor v_new is written or read back (unless a
   training forward keeps them for its backward: keep_states).
Intermediates (Aqk, M, w, u, v_new) are stored in the input dtype (fp32 for fp32 inputs), Gamma and the states in
fp32 except h[c], which is stored in the input dtype unless `return_intermediate_states` asks for it (fp32); L in
fp32, or in fp16 at inference on bf16 / fp16 inputs with the q / k L2 norm (l_in_fp16).
A training forward (chunk_fwd_pipeline's store_akk) has the intra kernel store Akk = k k^T with decay (no beta,
fp32) in place of L; the solve then applies beta to its row sums. What it keeps for the backward: kda/chunk.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import SUB_CHUNK
from .common import (
    RCP_LN2,
    _chunk_bounds,
    _f32,
    _layout_args,
    _load_lower_blocks,
    _load_tril,
    _seq_bounds,
    device_sms,
    fp32_dot_precision,
    launch_fitting,
    loop_range,
)
from .intra_fwd import _intra_sub_kernel
from .launch import (
    LAUNCH,
    fuse_output,
    intra_opts,
    launch_opts,
    recompute_dtypes,
    scan_opts,
    scan_segments,
    scan_v_block,
    solve_opts,
    v_block,
    wu_launch,
)
from .segments import run_segments, segment_tables
from .solve import _solve_kernel


def chunk_fwd_pipeline(q, k, v, g, beta, h0, *, scale, safe_shift, chunk_size, cu_seqlens, h_fp32, store_akk=False,
                       cu_host=None, g_check=None, keep_states=False, l_fp16=False, q_rstd=None):
    """Run the kernels; return a dict of every intermediate (see the module docstring for shapes):
    Gam, Aqk, Mm, w, u, vnew [T_all, HV, *]; hbuf [NT_all, HV, K, V]; o [B, T, HV, V]; ht [N, HV, K, V] fp32
    (vnew and hbuf None when the scan computed o: fuse_output, never with h_fp32);
    with `store_akk` (a training forward: the backward reads it) Akk = k k^T with decay, no beta, fp32
    [T_all, HV, BT], and Lkk None (the solve applies beta to Akk's rows itself); without, Lkk = diag(beta) Akk and
    Akk None. Of either, only the blocks j <= i of each chunk are written. cu_host: cu_seqlens as host ints, or
    None (chunk_layout).
    g_check: (floor, message) or None: the intra kernel also clears a flag (g_ok, int32 [1], returned) where some
    g < floor, and torch._assert_async fails with `message` unless the flag is still set (on a GPU at the next
    synchronisation): the safe gate's bound check without a pass of its own over g (a g.amin() took 69 us at
    (8, 4096, 16, 128) on the H200).
    keep_states (a training forward for the Triton backward): "states" = (w, vnew, hbuf, kg, qg), what the backward
    would otherwise recompute, when the scan computes the output and can store them in the dtypes the backward reads
    (launch.recompute_dtypes); else "states" is None (the backward recomputes them).
    l_fp16: L stored in fp16 rather than fp32 (without store_akk; the forward decides: l_in_fp16); with it and
    LAUNCH["intra"]["KSPLIT_FROM"] <= BK, "Lkk" and "Aqk" hold the K halves' two partial sums [2, T_all, HV, BT]
    (fp16). q_rstd: q is raw, its rows' L2 norms' inverses q_rstd [B T H] fp32 (l2norm_fwd without y; an inference
    forward, LAUNCH["intra"]["Q_RSTD"]): the intra kernel scales q's rows, or (the output kernel's path, which reads
    q itself) q is normalised here first."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dt = q.device, q.dtype
    BT, BC = chunk_size, SUB_CHUNK
    NC = BT // BC
    BK = max(16, triton.next_power_of_2(K))  # tl.dot needs every dimension >= 16
    q, k, v, g, beta = q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous(), g.contiguous(), beta.contiguous()
    N, NT, NT_all, chunk_indices, _, cu = _layout_args(B, T, BT, cu_seqlens, dev, cu_host, q)
    T_all = B * T
    f32 = torch.float32
    # the intra kernel's K split (an inference forward with fp16 L, LAUNCH["intra"]["KSPLIT_FROM"]): two programs per
    # sub-chunk, one per K half, whose partial sums (fp16: |.| <= 1 with the L2 norm) the solve adds (L) and the
    # output's reader adds (Aqk)
    split = l_fp16 and not store_akk and 0 < LAUNCH["intra"]["KSPLIT_FROM"] <= BK and BK >= 32  # halves >= 16 (dots)
    parts = 2 if split else 1
    r = {"Gam": torch.empty(T_all, HV, K, dtype=f32, device=dev),
         "Aqk": torch.empty(*((2,) if split else ()), T_all, HV, BT, dtype=torch.float16 if split else dt,
                            device=dev),  # [2, ...] fp16 partial sums with split
         "Lkk": torch.empty(*((2,) if split else ()), T_all, HV, BT,
                            dtype=torch.float16 if l_fp16 and not store_akk else f32,
                            device=dev),  # L, or Akk with store_akk (one buffer); [2, ...] partial sums with split
         "Mm": torch.empty(T_all, HV, BT, dtype=dt, device=dev),
         "o": torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)}
    launch = NT_all > 0 and HV > 0
    common = {"VARLEN": cu_seqlens is not None, "PREC": fp32_dot_precision() if dt == torch.float32 else "tf32"}
    Gam, Aqk, Lkk, Mm = r["Gam"], r["Aqk"], r["Lkk"], r["Mm"]
    r["Akk"], r["Lkk"] = (Lkk, None) if store_akk else (None, Lkk)
    # the output fused into the scan, unless the caller wants the states (h_fp32: return_intermediate_states)
    fused = launch and not h_fp32 and fuse_output(N, HV, V, K, dev)
    # qg = scale q exp2(Gamma) for the fused output, stored by the intra kernel, which holds q and Gamma anyway
    # (intra +33 us, w/u -66 against the w/u kernel loading q to store it: 6,258 against 6,297 us per fwd+bwd at
    # (8, 4096, 16, 128) on an H200)
    qg = torch.empty(T_all, HV, K, dtype=dt, device=dev) if fused else None
    if q_rstd is not None and not fused:  # as l2norm_fwd's y: x r in fp32, stored in q's dtype
        q, q_rstd = (q.float() * q_rstd.view(*q.shape[:-1], 1)).to(dt), None
    if keep_states and fused:
        keep_states = recompute_dtypes(dt) == (dt, dt)  # hbuf (and kg, qg) stored in dt by the fused forward
    else:
        keep_states = False
    if launch:
        shift = 0.0 if safe_shift is None else safe_shift * RCP_LN2
        intra = {"H": H, "HV": HV, "K": K, "BK": BK, "BT": BT, "BC": BC, "NC": NC, "SAFE": safe_shift is not None,
                 "STORE_AKK": store_akk, "CHECK_G": g_check is not None, "STORE_QG": qg is not None,
                 "Q_RSTD": q_rstd is not None, **common}
        g_ok = r["g_ok"] = torch.ones(1, dtype=torch.int32, device=dev) if g_check else Lkk
        part_stride = T_all * HV * BT  # elements between the K halves' partial sums
        intra.update(BK=BK // parts, KSPLIT=parts)
        _intra_sub_kernel[(NT_all * NC * parts, HV)](q, k, g, beta, Gam, Aqk, Lkk, g_ok,
                                                     qg if qg is not None else Lkk,
                                                     q_rstd if q_rstd is not None else Lkk, chunk_indices, cu,
                                                     float(scale), shift, float(g_check[0]) if g_check else 0.0,
                                                     T, NT, part_stride, **intra, **intra_opts(BK // parts))
        if g_check:
            torch._assert_async(g_ok, g_check[1])
        _solve_kernel[(NT_all, HV)](Lkk, beta, Mm, chunk_indices, cu, T, NT, part_stride, HV=HV,
                                    BT=BT, BC=BC, NC=NC, BETA=store_akk, PARTS=parts, **common,
                                    **solve_opts(store_akk))
    r["w"], r["u"], r["vnew"], r["hbuf"], r["ht"], kg, _ = chunk_fwd_states(
        k, v, beta, Gam, Mm, h0, chunk_size=BT, cu_seqlens=cu_seqlens, h_fp32=h_fp32, cu_host=cu_host,
        scale=scale, Aqk=Aqk if fused else None, o=r["o"] if fused else None, qg=qg, store_states=keep_states,
        aqk_parts=parts)
    r["states"] = (r["w"], r["vnew"], r["hbuf"], kg, qg) if keep_states else None  # not u: the backward reads v_new
    if launch and not fused:
        BVo = v_block("output", V, BK)
        _output_kernel[(triton.cdiv(V, BVo), NT_all, HV)](q, Gam, Aqk, r["vnew"], r["hbuf"], r["o"], chunk_indices,
                                                          cu, float(scale), T, NT, part_stride, H=H, HV=HV, K=K,
                                                          V=V, BK=BK, BV=BVo, BT=BT, AQK_PARTS=parts, **common,
                                                          **launch_opts("output"))
    return r


def chunk_fwd_states(k, v, beta, Gam, Mm, h0, *, chunk_size, cu_seqlens, h_fp32, cu_host=None, q=None, scale=1.0,
                     kq_dtype=None, Aqk=None, o=None, qg=None, store_states=False, aqk_parts=1):
    """Kernels 3 and 4 from Gamma and M: w, u (`_wu_kernel`), then the state scan with v_new (`_scan_kernel`).
    The forward's tail (chunk_fwd_pipeline) and the backward's only recompute (kda/chunk.py, from the Gam and
    Mm its forward saved).

    k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV] (any float dtype); Gam: [T_all, HV, K] fp32 (log2 units);
    Mm: [T_all, HV, BT] = (I + L)^-1 per chunk, in the input dtype (the dtype of w, u, v_new); h0: [N, HV, K, V] fp32
    or None. Returns (w [T_all, HV, K], u [T_all, HV, V], vnew [T_all, HV, V] in Mm.dtype, hbuf [NT_all, HV, K, V]
    = state entering each chunk, fp32 if h_fp32 else Mm.dtype, ht [N, HV, K, V] fp32, kg = k e^(Gamma_last - Gamma)
    [T_all, HV, K], qg = scale q e^Gamma [T_all, HV, K] when q [B, T, H, K] is given, else None; kg and qg in
    kq_dtype, default Mm.dtype). cu_host: as chunk_layout.
    With `o` ([B, T, HV, V], to be written), Aqk [T_all, HV, BT] and qg (scale q e^Gamma [T_all, HV, K], the intra
    kernel's) or q: the scan also computes the output o = qg h + Aqk v_new (step 5, `_scan_kernel`'s OUTPUT) and
    stores neither v_new nor the states (vnew and hbuf are returned as None) unless `store_states`. aqk_parts = 2:
    Aqk is [2, T_all, HV, BT], the intra kernel's K halves' partial sums, which the scan adds."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dt = k.device, Mm.dtype
    BT = chunk_size
    BK = max(16, triton.next_power_of_2(K))  # tl.dot needs every dimension >= 16
    k, v, beta = k.to(dt).contiguous(), v.to(dt).contiguous(), beta.contiguous()
    N, NT, NT_all, chunk_indices, chunk_offsets, cu = _layout_args(B, T, BT, cu_seqlens, dev, cu_host, k)
    T_all = B * T
    fused = o is not None
    states = not fused or store_states
    w, u = torch.empty(T_all, HV, K, dtype=dt, device=dev), torch.empty(T_all, HV, V, dtype=dt, device=dev)
    vnew = hbuf = None
    if states:
        vnew = torch.empty(T_all, HV, V, dtype=dt, device=dev)
        hbuf = torch.empty(NT_all, HV, K, V, dtype=torch.float32 if h_fp32 else dt, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    # k e^(Gamma_last - Gamma) (and scale q e^Gamma), from the w/u kernel to the scans
    kg = torch.empty(T_all, HV, K, dtype=kq_dtype or dt, device=dev)
    qg = qg if q is None else torch.empty_like(kg)
    if NT_all == 0 or HV == 0:
        ht.copy_(h0 if h0 is not None else torch.zeros_like(ht))
        return w, u, vnew, hbuf, ht, kg, qg
    varlen, prec = cu_seqlens is not None, fp32_dot_precision() if dt == torch.float32 else "tf32"
    qc = kg if q is None else q.contiguous()  # placeholder pointers without q (STORE_QG off)
    wu_ptrs = (k, v, beta, Gam, Mm, w, u, kg, qc, qg if q is not None else kg)
    wu_bv, wu_opts = wu_launch(V, BK, forward=q is None)
    wu_kw = {"H": H, "HV": HV, "K": K, "V": V, "BK": min(BK, LAUNCH["wu"]["BK"]), "BV": wu_bv, "BT": BT,
             "STORE_QG": q is not None, "PREC": prec, **wu_opts}
    BVs = scan_v_block(v_block("scan", V, BK), V, N * HV, device_sms(dev))
    h0c = h0.contiguous() if h0 is not None else ht
    grid = (triton.cdiv(V, BVs), N, HV)

    def scan_ptrs(h_in, h_out):  # placeholder pointers for the tensors a launch does not touch (OUTPUT, STORE_STATES)
        return (kg, w, u, Gam, vnew if states else w, hbuf if states else w, h_in, h_out, qg if fused else w,
                Aqk if fused else w, o if fused else w)

    scan_kw = {"H": H, "HV": HV, "K": K, "V": V, "BK": BK, "BV": BVs, "BT": BT, "STORE_HT": True, "OUTPUT": fused,
               "STORE_STATES": states, "PREC": prec, "AQK_PARTS": aqk_parts, **scan_opts(states, BK)}
    aqk_stride = T_all * HV * BT  # elements between Aqk's partial sums (aqk_parts = 2)
    P = scan_segments(NT, grid[0] * N * HV, cu_seqlens, dev)
    if not P:
        _wu_kernel[(NT_all, HV)](*wu_ptrs, chunk_indices, cu, float(scale), T, NT, VARLEN=varlen, **wu_kw)
        launch_fitting(_scan_kernel, grid, *scan_ptrs(h0c, ht), cu, chunk_offsets, T, NT, aqk_stride,
                       HAS_H0=h0 is not None, VARLEN=varlen, **scan_kw)
        return w, u, vnew, hbuf, ht, kg, qg
    cu_pad, segs = segment_tables(B, T, BT, P, dev)
    hts = (torch.empty_like(ht), torch.empty_like(ht))  # the state between segments, alternating

    def wu_segment(s):  # the segment's chunks as a varlen chunk list over the padded sequences
        _wu_kernel[(segs[s][3], HV)](*wu_ptrs, segs[s][0], cu_pad, float(scale), T, NT, VARLEN=True, **wu_kw)

    def scan_segment(s):  # from the previous segment's final state; the last one stores ht
        h_in, h_out = h0c if s == 0 else hts[(s - 1) % 2], ht if s == P - 1 else hts[s % 2]
        launch_fitting(_scan_kernel, grid, *scan_ptrs(h_in, h_out), segs[s][1], segs[s][2], T, NT, aqk_stride,
                       HAS_H0=h0 is not None or s > 0, VARLEN=2, **scan_kw)

    run_segments(P, dev, wu_segment, scan_segment, priority=LAUNCH["scan"]["SEGMENT_PRIORITY"])
    return w, u, vnew, hbuf, ht, kg, qg


@triton.jit
def _load_aqk(p, o_t, m_t, part_stride, PARTS: tl.constexpr):
    """A chunk's Aqk tile [BT, BT] at pointers p (its blocks j <= i; _load_lower_blocks), or with PARTS = 2 the sum
    of the intra kernel's two K halves' partial tiles (fp16, part_stride elements apart), added in fp16 (rounding
    2^-11 of |.| <= 1, below the bf16 rounding that follows; in fp32 the scan takes the same 255 registers and 8
    bytes of spill a thread, ptxas sm_90a). Added by the readers rather than by the solve: the solve's pass over
    both parts and its store of the sum cost 79 us a forward at (8, 4096, 16, 128) on an H200. The fused scan's PTX
    in bf16 converts the sum f16 -> f32 -> bf16 for its dot (cvt.f32.f16, cvt.rn.bf16x2.f32 at K = 64, V = 32), as it
    should."""
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
    # a counted loop (loop_range: tl.range when compiled), not while: a GPU compile software-pipelines the loop's loads
    # (chunk c + 1's w, u, Gamma, k while chunk c computes) with the launch's num_stages; a while loop never does
    for c in loop_range(0, n_chunks):
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
