"""Triton helpers shared by the chunkwise KDA kernels (triton_chunk.py forward, triton_chunk_bwd.py
backward): a program's chunk or sequence bounds (padded and varlen layouts) and the diagonal 16 x 16 block of the
intra-chunk step. Legend as in triton_chunk.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token of chunk i_t, its number of real tokens) for fixed-length or varlen sequences."""
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
        i_c = tl.load(chunk_indices + 2 * i_t + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_n = i_t // NT
        i_c = i_t % NT
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    start = bos + i_c * BT
    return start, tl.minimum(eos - start, BT).to(tl.int32)


@triton.jit
def _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token, end token, index of its first chunk among all chunks, number of chunks) of sequence i_n, for the
    state scans that walk one sequence's chunks in order (forward) or in reverse (backward)."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
        n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NT
        n_chunks = NT
    return bos, eos, c0, n_chunks


@triton.jit
def _diag_block(b_q, b_k, b_Gs, b_Gn, shift, BC: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr):
    """Diagonal [BC, BC] blocks of one sub-chunk: (Aqk with j <= i, Akk with j < i), fp32, from its rows b_q (scaled),
    b_k [BC, BK] fp32, Gamma b_Gs [BC, BK] (log2 units) and the anchor row b_Gn [BK]. With SAFE the fixed anchor
    C = Gamma_n - shift keeps exp2(Gamma_i - C) and exp2(C - Gamma_j) finite in fp32 (kda.md 3.3); otherwise exact
    pairwise exponents, one key column j at a time (any g, including -1000)."""
    o_c = tl.arange(0, BC)
    if SAFE:
        b_C = b_Gn - shift
        e_r = tl.exp2(b_Gs - b_C[None, :])
        b_kd = b_k * tl.exp2(b_C[None, :] - b_Gs)
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
