"""The forward state scan in two levels, for few long sequences (opt-in, untimed: triton_chunk.LAUNCH["scan"]
["SEGMENT"]). Legend as in triton_chunk.py; S segments in all, P = segments per sequence.

The state scan (triton_chunk.py step 4) walks a sequence's chunks in order, so with few sequences it runs few
programs: 64 at (1, 65536, 16, 128) on a GPU with 132 multiprocessors, and that shape's forward is scan-bound.
Per chunk the scan is an affine map of the state entering it (kda.md 3.1):

    h' = (Diag(e^Gamma_last) - kg^T w) h + kg^T u  =:  A_c h + b_c.

Cut every sequence into segments of SEGMENT chunks. A segment's map is the product of its chunks' maps,
h_end = A_s h_start + b_s, and both parts are scans the existing kernel can run with each segment as a sequence of
its own (a varlen layout over segment boundaries), all segments at once:
1. b_s: the scan from a zero state, storing only the final state (`_scan_kernel` FINAL_ONLY);
2. A_s [K, K]: the scan with u = 0 from the identity, the identity's K columns as the value dimension (ZERO_U), so
   the kernel multiplies the state by each chunk's A_c in turn, exactly as the scan does;
3. the states entering each segment, sequentially over one sequence's P segments: h_{s+1} = A_s h_s + b_s (batched
   fp32 matmuls over sequences and heads);
4. the scan itself over the segments from those states: every chunk's state, v_new (or the fused output) and the
   final states, as the one-level scan stores them, in the same chunk order.
Steps 1, 2 and 4 run S x HV x V-block programs instead of N x HV x V-block; the scan's work is done about three
times over (step 2 at V = K). The transitions are contractions for L2-normalized keys and beta in [0, 1] (the
eigenvalues of I - beta k k^T lie in [0, 1]), so composing them is stable in fp32.

The backward's reverse scan (triton_chunk_bwd.py) is affine too, in the gradient dh' of the state leaving a chunk:
dh = A_c^T dh' + (qg^T - w^T Aqk^T) do. `two_level_bwd_scan` runs the same four steps on `_bwd_scan_kernel` in
reverse: each segment's gradient map from a zero dh' (e_s) and with do = 0 from the identity (T_s), composed from a
sequence's last segment to its first, then the reverse scan of every segment from its leaving gradient.
"""

from __future__ import annotations

import torch
import triton

from . import triton_chunk, triton_chunk_bwd
from .triton_chunk import LAUNCH, chunk_layout, scan_stages, v_block


def use_two_level(N: int, HV: int, V: int, NT: int, BV: int, sms: int, varlen: bool) -> bool:
    """Whether a state scan runs in two levels: SEGMENT set, fixed-length sequences longer than one segment, and
    fewer scan programs (N * HV * V / BV) than multiprocessors."""
    seg = LAUNCH["scan"]["SEGMENT"]
    return bool(seg) and not varlen and NT > seg and 0 < N * HV * triton.cdiv(V, BV) < sms


def segment_layout(B: int, T: int, BT: int, seg_chunks: int, dev) -> tuple[torch.Tensor, list[int], int]:
    """Every one of B sequences of T tokens cut into segments of seg_chunks * BT tokens (the last one partial): the
    segment offsets as a varlen cu_seqlens (int32 on dev) and as host ints, and P, the segments per sequence."""
    L = seg_chunks * BT
    P = triton.cdiv(T, L)
    host = [n * T + s * L for n in range(B) for s in range(P)] + [B * T]
    cu = torch.tensor(host, dtype=torch.int32)
    if torch.device(dev).type == "cuda":  # pinned: the copy does not wait for the GPU queue
        cu = cu.pin_memory()
    return cu.to(dev, non_blocking=True), host, P


def two_level_scan(kg, w, u, Gam, vnew, hbuf, h0, ht, qg, Aqk, o, *, T, K, V, BK, BV, BT, common):
    """Steps 1-4 above, in place of triton_chunk's one-level `_scan_kernel` launch, with its arguments: kg, w [T_all,
    HV, K], u [T_all, HV, V], Gam fp32, vnew / hbuf (or None with the fused output: o, qg, Aqk), h0 [N, HV, K, V]
    fp32 or None, ht [N, HV, K, V] fp32 (written); `common`: VARLEN (False) and PREC."""
    N, HV = ht.shape[0], ht.shape[1]
    dev, f32 = kg.device, torch.float32
    cu, host, P = segment_layout(N, T, BT, LAUNCH["scan"]["SEGMENT"], dev)
    S, _, _, _, chunk_offsets, cu = chunk_layout(N, T, BT, cu, dev, host)
    seg = {**common, "VARLEN": True}
    shape = {"H": HV, "HV": HV, "K": K, "BK": BK, "BT": BT, "HAS_H0": True, "STORE_HT": True, "OUTPUT": False,
             "FINAL_ONLY": True}
    opts = scan_stages(LAUNCH["scan"], BV, V, S * HV, 0)  # many programs now: the plain launch settings
    # 1. b_s: each segment from a zero state (HAS_H0 off); 2. A_s: from the identity with u = 0, V = K
    scan = triton_chunk._scan_kernel  # looked up at call time (tests wrap the kernel)
    b, A = torch.empty(S, HV, K, V, dtype=f32, device=dev), torch.empty(S, HV, K, K, dtype=f32, device=dev)
    eye = torch.eye(K, dtype=f32, device=dev).expand(S, HV, K, K).contiguous()
    scan[(triton.cdiv(V, BV), S, HV)](kg, w, u, Gam, w, w, w, b, w, w, w, cu, chunk_offsets, T, 0,
                                            **{**shape, "HAS_H0": False}, V=V, BV=BV, **seg, **opts)
    BA = v_block("scan", K, BK)
    scan[(triton.cdiv(K, BA), S, HV)](kg, w, w, Gam, w, w, eye, A, w, w, w, cu, chunk_offsets, T, 0, **shape,
                                            V=K, BV=BA, ZERO_U=True, **seg, **opts)
    # 3. the state entering each segment, one sequence's segments in order (all sequences and heads batched)
    A, b = A.view(N, P, HV, K, K), b.view(N, P, HV, K, V)
    h_in = torch.empty(N, P, HV, K, V, dtype=f32, device=dev)
    h = h0.float() if h0 is not None else torch.zeros(N, HV, K, V, dtype=f32, device=dev)
    for s in range(P):
        h_in[:, s] = h
        h = torch.baddbmm(b[:, s].reshape(-1, K, V), A[:, s].reshape(-1, K, K), h.reshape(-1, K, V)).view_as(h)
    # 4. the scan over the segments from those states: per-chunk outputs in the one-level scan's chunk order
    fused = o is not None
    ht_seg = torch.empty(S, HV, K, V, dtype=f32, device=dev)
    scan[(triton.cdiv(V, BV), S, HV)](kg, w, u, Gam, w if fused else vnew, w if fused else hbuf,
                                            h_in.view(S, HV, K, V), ht_seg, qg if fused else w, Aqk if fused else w,
                                            o if fused else w, cu, chunk_offsets, T, 0,
                                            **{**shape, "FINAL_ONLY": False, "OUTPUT": fused}, V=V, BV=BV, **seg,
                                            **opts)
    ht.copy_(ht_seg.view(N, P, HV, K, V)[:, -1])


def two_level_bwd_scan(qg, kg, w, Gam, Aqk, do, dht, dvn, dhs, dh0, *, T, K, V, BK, BV, BT, prec):
    """The reverse scan's four steps in place of triton_chunk_bwd's one-level `_bwd_scan_kernel` launch, with its
    arguments (dht [N, HV, K, V] fp32: the final state's gradient; dvn, dhs, dh0 written); prec: its dot precision."""
    N, HV = dht.shape[0], dht.shape[1]
    dev, f32 = kg.device, torch.float32
    cu, host, P = segment_layout(N, T, BT, LAUNCH["scan"]["SEGMENT"], dev)
    S, _, _, _, chunk_offsets, cu = chunk_layout(N, T, BT, cu, dev, host)
    kern = triton_chunk_bwd._bwd_scan_kernel  # looked up at call time (tests wrap the kernel)
    shape = {"H": HV, "HV": HV, "K": K, "BK": BK, "BT": BT, "VARLEN": True, "PREC": prec, "FINAL_ONLY": True,
             **scan_stages(triton_chunk_bwd.LAUNCH["bwd_scan"], BV, V, S * HV, 0)}
    # 1. e_s: each segment's gradient from a zero dh'; 2. T_s: with do = 0 from the identity, V = K
    e, Tm = torch.empty(S, HV, K, V, dtype=f32, device=dev), torch.empty(S, HV, K, K, dtype=f32, device=dev)
    zero, eye = torch.zeros(S, HV, K, V, dtype=f32, device=dev), torch.eye(K, dtype=f32, device=dev)
    kern[(triton.cdiv(V, BV), S, HV)](qg, kg, w, Gam, Aqk, do, zero, w, w, e, cu, chunk_offsets, T, 0, V=V, BV=BV,
                                      **shape)
    BA = v_block("scan", K, BK)
    kern[(triton.cdiv(K, BA), S, HV)](qg, kg, w, Gam, Aqk, do, eye.expand(S, HV, K, K).contiguous(), w, w, Tm, cu,
                                      chunk_offsets, T, 0, V=K, BV=BA, ZERO_DO=True, **shape)
    # 3. the gradient leaving each segment, from a sequence's last segment back to its first
    Tm, e = Tm.view(N, P, HV, K, K), e.view(N, P, HV, K, V)
    d_out = torch.empty(N, P, HV, K, V, dtype=f32, device=dev)
    d = dht.float()
    for s in reversed(range(P)):
        d_out[:, s] = d
        d = torch.baddbmm(e[:, s].reshape(-1, K, V), Tm[:, s].reshape(-1, K, K), d.reshape(-1, K, V)).view_as(d)
    # 4. the reverse scan of every segment from its leaving gradient: dv_new and dh' per chunk, dh0 per segment
    dh0_seg = torch.empty(S, HV, K, V, dtype=f32, device=dev)
    kern[(triton.cdiv(V, BV), S, HV)](qg, kg, w, Gam, Aqk, do, d_out.view(S, HV, K, V), dvn, dhs, dh0_seg, cu,
                                      chunk_offsets, T, 0, V=V, BV=BV, **{**shape, "FINAL_ONLY": False})
    dh0.copy_(dh0_seg.view(N, P, HV, K, V)[:, 0])
