"""Fused intra-chunk + solve forward kernel for the Triton KDA chunk pipeline (triton_chunk.FWD_INTRA = "fused").

Legend as in triton_chunk.py: T_all total tokens, H q/k heads, HV value heads, K key dim, BK = next_pow2(K),
BT chunk size (16/32/64), BC = 16 sub-chunk, NC = BT / BC.

The split pipeline runs `_intra_kernel` (Gamma, Aqk, Akk, and L = diag(beta) k k^T with decay written to an fp32
[T_all, HV, BT] buffer) and then `_solve_kernel`, which reads L back only to invert its unit-lower-triangular chunk
blocks. `_intra_solve_kernel` does both in one program per (chunk, value head): the same sub-chunk rows, anchors and
decay factors as `_intra_kernel` (kda.md 3.3), then M = (I + L)^-1 (kda.md 3.1, 3.2 step 2b) from L held in
registers, stored into Mm in the input dtype. L never goes to memory (saves an fp32 [T_all, HV, BT] write + read
and one launch).

How the 16 x 16 blocks L_sj (j < s) are formed: they are cut out of the [BC, BT] row block that the off-diagonal
dot of sub-chunk s already produces (reshape to [BC, NC, BC], select block j with a mask, sum over that axis: exact,
one nonzero term). Trade-off: the alternative, one [BC, BK] x [BK, BC] dot per (s, j) with its own key factor,
needs the key rows and Gamma rows of sub-chunk j as [BC, BK] tiles (16 fp32 registers per thread each at K = 128,
4 warps), on top of the ~240 registers `_intra_kernel` already uses at K = 128; the mask extraction needs only an
[BC, BT] temporary (8 registers per thread) and no extra dots, and its L values are bit-identical to the ones the
split pipeline stores, so both variants agree to rounding of the merges alone. Live M blocks at the last sub-chunk
(NC = 4): six 16 x 16 fp32 blocks, 12 registers per thread.

Register pressure, measured without a GPU (Triton 3.6 compiled for sm_90a, bundled ptxas 12.8 -v; bf16, K = 128,
BT = 64, safe gate, 4 warps, 2 stages): `_intra_kernel` already hits 255 registers and spills 608 B stores /
1004 B loads per thread; this kernel spills 1024 / 1652 B (8 warps: 380 / 488 vs 480 / 708). Computing every
sub-chunk's rows first and the solve afterwards (so the [BT, BK] Gamma and key tiles are dead during the solve)
spilled more (1204 / 1664 B): the L blocks then live through the row phase instead of the M blocks. Interleaved
(row block s, then its M blocks) is kept.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk import _inv_unit_lower, _merge_row1, _merge_row2, _merge_row3, _store_block
from .triton_common import _chunk_bounds, _chunk_gamma_keys, _sub_chunk_rows

# Triton launch settings of the fused kernel (benchmarks/kda_tune.py sweeps them like triton_chunk.LAUNCH); untuned:
# the split intra kernel's (4 warps, 2 stages on an H200, RESULTS.md)
LAUNCH: dict[str, dict[str, int]] = {"intra_solve": {"num_warps": 4, "num_stages": 2}}


@triton.jit
def _col_block(b_row, j: tl.constexpr, BC: tl.constexpr, NC: tl.constexpr):
    """Columns [j * BC, (j + 1) * BC) of a [BC, NC * BC] row block as [BC, BC]: a masked sum over the block axis
    of its [BC, NC, BC] view (one nonzero term per element, so exact)."""
    o_nc = tl.arange(0, NC)
    b_3 = tl.reshape(b_row, (BC, NC, BC))
    return tl.sum(tl.where(o_nc[None, :, None] == j, b_3, 0.0), axis=1)


@triton.jit
def _intra_solve_kernel(q, k, g, beta, Gam, Aqk, Akk, Mm, chunk_indices, cu_seqlens, scale, shift, T, NT,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                        BC: tl.constexpr, NC: tl.constexpr, SAFE: tl.constexpr, STORE_AKK: tl.constexpr,
                        VARLEN: tl.constexpr, PREC: tl.constexpr):
    """Gamma [T_all, HV, K] fp32, Aqk [T_all, HV, BT], Akk [T_all, HV, BT] fp32 (only with STORE_AKK) exactly as
    `_intra_kernel`; M = (I + L)^-1 [T_all, HV, BT] (blocks j <= i, input dtype) exactly as `_solve_kernel`:
    diagonal blocks by forward substitution, off-diagonal ones by M_ij = -M_ii sum_{j <= m < i} L_im M_mj."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    b_G, b_G3, b_kall = _chunk_gamma_keys(k, g, Gam, start, n_valid, i_h, i_hv, H, HV, K, BK, BT, BC, NC)
    # rows past n_valid have q = k = beta = 0, so their L rows are 0, as `_solve_kernel` reads them
    _, L00 = _sub_chunk_rows(q, k, beta, Aqk, Akk, Akk, b_G3, b_G, b_kall, start, n_valid, i_h, i_hv, scale, shift, 0,
                             H, HV, K, BK, BT, BC, NC, SAFE, STORE_AKK, False, PREC)
    M00 = _inv_unit_lower(L00, BC)
    _store_block(Mm, M00, start, n_valid, i_hv, 0, 0, HV, BT, BC)
    if NC > 1:
        Lr1, L11 = _sub_chunk_rows(q, k, beta, Aqk, Akk, Akk, b_G3, b_G, b_kall, start, n_valid, i_h, i_hv, scale,
                                   shift, 1, H, HV, K, BK, BT, BC, NC, SAFE, STORE_AKK, False, PREC)
        L10 = _col_block(Lr1, 0, BC, NC)
        M11 = _inv_unit_lower(L11, BC)
        M10 = _merge_row1(M11, L10, M00, PREC)
        _store_block(Mm, M11, start, n_valid, i_hv, 1, 1, HV, BT, BC)
        _store_block(Mm, M10, start, n_valid, i_hv, 1, 0, HV, BT, BC)
    if NC > 2:
        Lr2, L22 = _sub_chunk_rows(q, k, beta, Aqk, Akk, Akk, b_G3, b_G, b_kall, start, n_valid, i_h, i_hv, scale,
                                   shift, 2, H, HV, K, BK, BT, BC, NC, SAFE, STORE_AKK, False, PREC)
        L20 = _col_block(Lr2, 0, BC, NC)
        L21 = _col_block(Lr2, 1, BC, NC)
        M22 = _inv_unit_lower(L22, BC)
        M21, M20 = _merge_row2(M22, L20, L21, M00, M10, M11, PREC)
        _store_block(Mm, M22, start, n_valid, i_hv, 2, 2, HV, BT, BC)
        _store_block(Mm, M21, start, n_valid, i_hv, 2, 1, HV, BT, BC)
        _store_block(Mm, M20, start, n_valid, i_hv, 2, 0, HV, BT, BC)
        Lr3, L33 = _sub_chunk_rows(q, k, beta, Aqk, Akk, Akk, b_G3, b_G, b_kall, start, n_valid, i_h, i_hv, scale,
                                   shift, 3, H, HV, K, BK, BT, BC, NC, SAFE, STORE_AKK, False, PREC)
        L30 = _col_block(Lr3, 0, BC, NC)
        L31 = _col_block(Lr3, 1, BC, NC)
        L32 = _col_block(Lr3, 2, BC, NC)
        M33 = _inv_unit_lower(L33, BC)
        M32, M31, M30 = _merge_row3(M33, L30, L31, L32, M00, M10, M11, M20, M21, M22, PREC)
        _store_block(Mm, M33, start, n_valid, i_hv, 3, 3, HV, BT, BC)
        _store_block(Mm, M32, start, n_valid, i_hv, 3, 2, HV, BT, BC)
        _store_block(Mm, M31, start, n_valid, i_hv, 3, 1, HV, BT, BC)
        _store_block(Mm, M30, start, n_valid, i_hv, 3, 0, HV, BT, BC)
