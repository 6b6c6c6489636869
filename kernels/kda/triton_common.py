"""Triton helpers of the chunkwise KDA kernels (triton_chunk.py forward, triton_chunk_bwd.py backward): the device's
multiprocessor count for the launch heuristics, a launch that falls back to 1 stage where a pipelined one does not
fit, a program's chunk or sequence bounds (padded and varlen layouts, both directions), the diagonal 16 x 16 block of
the forward's intra-chunk step, and its kernel, one program per sub-chunk (`_intra_sub_kernel`). Legend as in
triton_chunk.py.
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .chunk import SUB_CHUNK

# the 16 x 16 blocks (BC = chunk.SUB_CHUNK) in which the intra kernel and the solve write the triangular [BT, BT] tiles
BLOCK: tl.constexpr = tl.constexpr(SUB_CHUNK)


@functools.cache
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device `index` (the `sms` of the launch heuristics)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(dev: torch.device) -> int:
    """sm_count of a CUDA device; 0 elsewhere (the CPU interpreter keeps LAUNCH's V blocks)."""
    return sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 0


# launches whose pipelined kernel did not fit its device's shared memory, relaunched at 1 stage (launch_fitting)
_UNFIT: set[tuple] = set()

# the dot precisions K3_KDA_FP32_DOTS may pick for fp32 inputs: "tf32x3" (the default: three tf32 MMAs per product,
# hi * hi + hi * lo + lo * hi, near fp32 on the tensor cores), "ieee" (fp32 FMA, no tensor cores) or "tf32" (one MMA,
# 10-bit mantissas: Triton's own default for fp32 dots, which fla-core 0.6.0's kernels take)
FP32_DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")


def fp32_dot_precision() -> str:
    """The precision of every chunk-kernel dot (forward and backward) for fp32 inputs, from K3_KDA_FP32_DOTS (read at
    each call). tf32x3 by default. H200, fp32 at (8, 4096, 16, 128), fwd / fwd+bwd ms (2026-11-30, RESULTS.md session
    14): ieee 91.1 / 241.1; tf32x3 4.58 / 21.2, its output within 4.8e-7 relative RMS of ieee's, and the fp32 GPU
    tests pass with it; tf32 2.56 / 9.26, 1.8e-3 off."""
    raw = os.environ.get("K3_KDA_FP32_DOTS", "tf32x3").strip().lower() or "tf32x3"
    if raw not in FP32_DOT_PRECISIONS:
        raise ValueError(f"K3_KDA_FP32_DOTS must be one of {FP32_DOT_PRECISIONS}, got {raw!r}; unset it for "
                         "'tf32x3'")
    return raw


def _launch_key(kernel, args, kw) -> tuple:
    """What decides a compiled kernel's shared memory: the kernel, its constexprs and launch options, its tensors'
    dtypes, the device."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (kernel.__name__, tuple(sorted(kw.items())), tuple(a.dtype for a in tensors), tensors[0].device)


def launch_fitting(kernel, grid, *args, **kw) -> None:
    """kernel[grid](*args, **kw), at 1 stage instead of kw's num_stages where the pipelined kernel's shared memory
    does not fit the device: Triton raises OutOfResources when it loads the compiled kernel, before anything runs.
    The state scans at 3 stages need up to 216 KB in bf16 at K = 128 (an H200 gives a block 227 KB), but 288 KB in
    fp32 and 376 KB at K = 256 (sm_90a; RESULTS.md session 11). A refused launch is remembered, so it is tried
    once per signature; the check costs nothing while none was refused."""
    if _UNFIT and _launch_key(kernel, args, kw) in _UNFIT:
        kw = {**kw, "num_stages": 1}
    try:
        kernel[grid](*args, **kw)
    except OutOfResources:
        if kw.get("num_stages", 1) == 1:
            raise
        _UNFIT.add(_launch_key(kernel, args, kw))
        kernel[grid](*args, **{**kw, "num_stages": 1})


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b, accumulated in fp32. PREC: a tl.dot input_precision ('ieee', 'tf32', 'bf16x3'), or 'bf16': both operands
    rounded to bf16 first, one MMA per tile (what fla-core 0.6.0 does in its inter-chunk backward kernels).
    'bf16_emulated' is 'bf16' for Triton 3.6's CPU interpreter, whose tl.dot of bf16 operands returns garbage
    (~1e10 off at 16 x 16) and whose fp32 -> bf16 cast truncates: the fp32 operands rounded to the nearest bf16
    (ties to even, as the GPU's cast), then multiplied in fp32 (what the MMA computes)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_emulated":
        return tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: add half an ulp of the 16 dropped bits
    (minus one unless the kept lowest bit is 1) and clear them. Finite inputs only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


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
def _f32(x):
    """A float scalar argument as fp32 (every chunk, gate, L2-norm and decode kernel takes its float scalars through
    this at entry). Triton's launcher passes a Python float as fp32, but inductor, launching a kernel inside
    torch.compile, as fp64 (torch 2.11, H200 2026-11-30), and an fp64 scalar makes the tiles it touches fp64 or fails
    the compile ("Both operands must be same dtype")."""
    return tl.full([], x, tl.float32)


@triton.jit
def _load_lower_blocks(p, o_t, m_t):
    """A chunk's [BT, BT] tile at pointers p (o_t = arange(BT), m_t its valid rows), its 16 x 16 blocks j // 16 <=
    i // 16 as stored and 0 in the blocks above them and in rows past the end: for a tile whose writer zeroes the
    upper part of its diagonal blocks itself and leaves the blocks above unwritten (Aqk, the intra kernel's)."""
    return tl.load(p, mask=m_t[:, None] & ((o_t[None, :] // BLOCK) <= (o_t[:, None] // BLOCK)), other=0.0)


@triton.jit
def _load_tril(p, o_t, m_t, STRICT: tl.constexpr):
    """A chunk's lower-triangular [BT, BT] tile at pointers p (o_t = arange(BT), m_t its valid rows): j <= i (j < i
    with STRICT) as stored, 0 elsewhere and in rows past the end. Loaded with a mask of whole 16 x 16 blocks (the
    blocks j // 16 <= i // 16, which the intra kernel and the solve write), then cut to the triangle in registers:
    the element mask left each thread 2- or 4-byte loads (ptxas, sm_90a: 32 ld.global.b16 a thread in the w/u
    kernel), the block mask 16-byte ones. What the upper part of a diagonal block holds (even NaN) is discarded.
    H200 (kda_tune.py, 2026-11-30, RESULTS.md session 20): backward inter kernel 1,200 -> 1,115 us at (16, 2048, 32,
    64) in three A/B rounds, 1,354 -> 1,341 at (8, 4096, 16, 128); the w/u kernel unchanged (294 / 264 us)."""
    b = _load_lower_blocks(p, o_t, m_t)
    return tl.where((o_t[None, :] < o_t[:, None]) if STRICT else (o_t[None, :] <= o_t[:, None]), b, 0.0)


@triton.jit
def _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token, end token, index of its first chunk among all chunks, number of chunks) of sequence i_n, for the
    state scans that walk one sequence's chunks in order (forward) or in reverse (backward). VARLEN 2: cu_seqlens
    holds (first token, end token) pairs, one per sequence (a time segment of each, triton_segments.py)."""
    if VARLEN == 2:
        bos = tl.load(cu_seqlens + 2 * i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + 2 * i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
        n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    elif VARLEN:
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
def _diag_block(b_q, b_k, b_Gs, b_en, shift, BC: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr):
    """Diagonal [BC, BC] blocks of one sub-chunk: (Aqk with j <= i, Akk with j < i), fp32, from its rows b_q (scaled),
    b_k [BC, BK] fp32, Gamma b_Gs [BC, BK] relative to the anchor row n (log2 units; zero at row n) and
    b_en = exp2(b_Gs) (the caller's query factor; 0 is fine in rows and columns where b_q and b_k are 0). With SAFE
    the fixed anchor C = Gamma_n - shift = -shift keeps exp2(Gamma_i - C) and exp2(C - Gamma_j) finite in fp32
    (kda.md 3.3); otherwise exact pairwise exponents, one key column j at a time (any g, including -1000)."""
    o_c = tl.arange(0, BC)
    if SAFE:
        # exp2(Gamma_i - C) = exp2(Gamma_i - Gamma_n) exp2(shift): one multiply in place of a tile of exponentials
        e_r = b_en * tl.exp2(shift)
        b_kd = b_k * tl.exp2(-shift - b_Gs)
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


@triton.jit
def _intra_sub_kernel(q, k, g, beta, Gam, Aqk, Lkk, g_ok, qg, q_rstd, chunk_indices, cu_seqlens, scale, shift, g_floor,
                      T, NT, part_stride,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                      BC: tl.constexpr, NC: tl.constexpr, SAFE: tl.constexpr, STORE_AKK: tl.constexpr,
                      CHECK_G: tl.constexpr, STORE_QG: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                      KSPLIT: tl.constexpr, Q_RSTD: tl.constexpr):
    """The forward's intra-chunk step (triton_chunk.py, step 1), one program per (chunk, 16-token sub-chunk i, value
    head): the BC rows of sub-chunk i of Gamma, Aqk and Lkk, [BC, BK] tiles only (the backward's intra kernel has
    the same shape). Lkk gets L = diag(beta) k k^T with decay, or with STORE_AKK (a training forward) Akk = k k^T
    with decay, without beta (the backward's d(beta) needs it; the solve then applies beta itself): one buffer
    written, not two (fp32; or fp16 for L, chunk_fwd_pipeline's l_fp16). Only the blocks j <= i of Aqk and Lkk are
    written: the solve, the w/u kernel, the scans and the output kernel load no others (_load_lower_blocks,
    _load_tril). Writing Aqk's blocks above as zeros (as before) cost the intra kernel 9 / 25 us at (8, 4096, 16,
    128) / (16, 2048, 32, 64) with an fp32 L, 15 / -5 with an fp16 L (H200, inference forward, one run each,
    kda_tune.py, 2026-11-30, RESULTS.md session 21), and the scan reads 6 fewer blocks of 16 a chunk.
    One pass over the sub-chunks before i, from i - 1 down to 0: each key's exponent Gamma_n - Gamma_c (<= 0, anchor
    n = the first row of sub-chunk i, kda.md 3.3) is the running sum of g from row c + 1 to row n, and the carry into
    sub-chunk i (the sum of g before it) comes out of the same walk, so Gamma is stored after it. Own rows take Gamma
    relative to the anchor (exactly zero at row n); both factors of an off-diagonal block (j < i) are <= 1. The
    diagonal block by `_diag_block`. Each program reads every earlier sub-chunk's g once: 716 us per fwd+bwd at
    (8, 4096, 16, 128) on the H200 against 844 for the former form, which first summed the earlier sub-chunks' g
    into the carry, then read them again (2 warps, kda_tune.py, 2026-11-30).
    CHECK_G: the safe gate's bound check, which then costs no pass of its own over g: a program whose rows hold a g
    below g_floor stores 0 into the flag g_ok (int32 [1], 1 before the launch; every such program stores the same
    value, so the race is harmless). Before, each program stored its rows' minimum and a torch amin reduced them:
    that reduction and its comparison took ~10-15 us a forward on the H200 (kda_tune.py's torch ops, session 17).
    STORE_QG: also store qg = scale q exp2(Gamma) [T_all, HV, K] (the scan's fused output reads it), from the rows
    and Gamma this program holds anyway.
    KSPLIT = 2 (chunk_fwd_pipeline's K split): the two programs 2 s and 2 s + 1 of grid axis 0 take K half p = 0, 1
    of sub-chunk s, columns p BK .. p BK + BK - 1 of q, k, g, Gamma and qg, and store their partial sums of Aqk and
    Lkk at part p of [2, T_all, HV, BT] buffers (part_stride = T_all HV BT elements apart): the solve adds L's, Aqk's
    readers (the fused scan, the output kernel: triton_fwd_kernels._load_aqk) Aqk's. Gamma is per column, so the
    split needs no exchange. The offsets go on the base pointers, so the tiles' index arithmetic is the unsplit
    kernel's. A sub-chunk's two halves are adjacent in the launch order, so they run at about the same time and read
    the two halves of the same rows of q, k and g (neighbouring addresses); on a third grid axis (every first half
    launched before any second) this kernel took 556 us against 527 at (8, 4096, 16, 128) (H200, inference forward,
    kda_tune.py, 2026-12-01, RESULTS.md session 23; the cause was not profiled).
    Q_RSTD: q is raw and its rows' L2 norms' inverses q_rstd [T_all H] fp32 scale this kernel's results: an
    inference forward's q is read by this kernel alone (its own rows: the walk reads k and g only), so the norm pass
    stores rstd and no normalised copy of q (chunk_fwd_pipeline's q_rstd). Scaling the rows of Aqk's blocks and of
    qg as stored instead (so that the load of q_rstd waits behind the walk) lost on the H200: inference forward
    1,305 / 1,307 -> 1,310 / 1,309 us at (8, 4096, 16, 128) (kda_tune.py, 2026-12-01, RESULTS.md session 22)."""
    scale, shift, g_floor = _f32(scale), _f32(shift), _f32(g_floor)  # fp64 when inductor launches us
    i_s, i_hv = tl.program_id(0) // KSPLIT, tl.program_id(1)  # i_s: the sub-chunk
    i_t, i_i = i_s // NC, i_s % NC
    i_h = i_hv // (HV // H)
    start, n_valid = _chunk_bounds(i_t, chunk_indices, cu_seqlens, T, NT, BT, VARLEN)
    if i_i * BC >= n_valid:  # past the end of a partial chunk: no rows
        return
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    if KSPLIT == 2:  # this program's K half: columns k0 .. k0 + BK - 1 through the base pointers
        i_p = tl.program_id(0) % KSPLIT
        k0 = i_p * BK
        q, k, g, Gam, qg = q + k0, k + k0, g + k0, Gam + k0, qg + k0
        Aqk, Lkk = Aqk + i_p * part_stride, Lkk + i_p * part_stride
        m_k = o_k < K - k0
    else:
        m_k = o_k < K
    log2e = 1.4426950408889634
    r_i = i_i * BC + o_c
    m_i = r_i < n_valid
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = ((start + r_i[:, None]) * HV + i_hv) * K + o_k[None, :]
    p_iq = ((start + r_i[:, None]) * H + i_h) * K + o_k[None, :]
    b_gi = tl.load(g + p_ik, mask=m_ik, other=0.0).to(tl.float32)
    if CHECK_G:  # masked entries read 0, above any lower bound
        tl.store(g_ok, tl.full([], 0, tl.int32), mask=tl.min(tl.min(b_gi, axis=1), axis=0) < g_floor)
    # Gamma relative to the anchor n (the sub-chunk's first row, exactly zero there), so the anchor's own Gamma
    # drops out of every exponent below; absolute Gamma is stored once the walk below has the carry
    # g of the anchor row [BK], loaded again (a cache hit) rather than picked out of b_gi by a reduction over rows.
    # With _diag_block's row factor taken from e_q: 129 against 160 ex2 in the PTX (sm_90a, 2 warps), this kernel
    # 698 -> 676 us at (8, 4096, 16, 128), 548 (unchanged) at (16, 2048, 32, 64) (H200, kda_tune.py --defaults,
    # 2026-11-30, RESULTS.md session 12)
    b_gn = tl.load(g + ((start + i_i * BC) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_G = (tl.cumsum(b_gi, axis=0) - b_gn[None, :]) * log2e
    b_q = tl.load(q + p_iq, mask=m_ik, other=0.0).to(tl.float32) * scale
    if Q_RSTD:
        b_q *= tl.load(q_rstd + (start + r_i) * H + i_h, mask=m_i, other=0.0)[:, None]
    b_k = tl.load(k + p_iq, mask=m_ik, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (start + r_i) * HV + i_hv, mask=m_i, other=0.0).to(tl.float32)
    # Gamma_i - Gamma_n <= 0. Not masked: rows past the end read g = 0 (finite Gamma there) and q = k = 0, so every
    # product with e_q is 0 there as with a masked factor (bit-identical; 32 selects fewer per thread in the PTX)
    e_q = tl.exp2(b_G)
    b_qf = (b_q * e_q).to(k.dtype.element_ty)
    b_kf = (b_k * e_q).to(k.dtype.element_ty)
    p_rows = ((start + r_i[:, None]) * HV + i_hv) * BT  # row r_i of Aqk / Lkk
    # off-diagonal blocks (i, j), j < i, walked downwards from j = i - 1 (b_cj: the sum of g over sub-chunks
    # j + 1 .. i - 1)
    b_cj = tl.zeros([BK], dtype=tl.float32)
    for jb in range(i_i):
        j = i_i - 1 - jb
        r_j = j * BC + o_c
        p_jk = ((start + r_j[:, None]) * HV + i_hv) * K + o_k[None, :]
        b_gj = tl.load(g + p_jk, mask=m_k[None, :], other=0.0).to(tl.float32)
        # Gamma_c relative to the anchor: -(g_n + g over sub-chunks j + 1 .. i - 1 + g of rows c + 1 .. of
        # sub-chunk j), every term a sum of g <= 0
        b_tj = tl.sum(b_gj, axis=0)
        b_Gj = (tl.cumsum(b_gj, axis=0) - (b_gn + b_cj + b_tj)[None, :]) * log2e
        b_cj += b_tj
        b_kc = tl.load(k + ((start + r_j[:, None]) * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_kc = (b_kc.to(tl.float32) * tl.exp2(tl.where(m_k[None, :], -b_Gj, float("-inf"))))  # Gamma_n - Gamma_c
        b_kc = b_kc.to(k.dtype.element_ty)
        b_A = tl.dot(b_qf, tl.trans(b_kc), input_precision=PREC)  # [BC, BC]
        b_L = tl.dot(b_kf, tl.trans(b_kc), input_precision=PREC)
        p_b = p_rows + r_j[None, :]
        tl.store(Aqk + p_b, b_A.to(Aqk.dtype.element_ty), mask=m_i[:, None])
        if STORE_AKK:
            tl.store(Lkk + p_b, b_L, mask=m_i[:, None])
        else:
            tl.store(Lkk + p_b, b_L * b_b[:, None], mask=m_i[:, None])
    # absolute Gamma = carry + cumsum, the carry into sub-chunk i being b_cj now
    b_Ga = b_G + ((b_cj + b_gn) * log2e)[None, :]
    tl.store(Gam + p_ik, b_Ga, mask=m_ik)
    if STORE_QG:  # computed as the w/u kernel's recompute does (the backward may read either), bit for bit
        tl.store(qg + p_ik, (b_q * tl.exp2(b_Ga)).to(qg.dtype.element_ty), mask=m_ik)
    b_Ad, b_Ld = _diag_block(b_q, b_k, b_G, e_q, shift, BC, SAFE, PREC)
    p_d = p_rows + r_i[None, :]
    tl.store(Aqk + p_d, b_Ad.to(Aqk.dtype.element_ty), mask=m_i[:, None])
    if STORE_AKK:
        tl.store(Lkk + p_d, b_Ld, mask=m_i[:, None])
    else:
        tl.store(Lkk + p_d, b_Ld * b_b[:, None], mask=m_i[:, None])


_LAYOUT_CACHE: list = []  # [(weakref to cu_seqlens, its _version, chunk_size, device, layout)], the latest few


def chunk_layout(B, T, chunk_size, cu_seqlens, device, cu_host=None):
    """Chunk bookkeeping shared by forward and backward: (N, NT, NT_all, chunk_indices [NT_all, 2] int32,
    chunk_offsets [N + 1] int32, cu_seqlens int32); the index tensors are None without varlen.

    The varlen layout needs the sequence lengths on the host: `cu_host` (the offsets as host ints, from callers that
    have them) or else one read of cu_seqlens, which waits for the GPU queue. The two index tables then go to the
    device in one copy that does not wait. A model calls this with the same cu_seqlens tensor in every layer, forward
    and backward, so the result is reused while that very tensor object is alive and unmodified (identity +
    _version)."""
    if cu_seqlens is None:
        NT = triton.cdiv(T, chunk_size)
        return B, NT, B * NT, None, None, None
    for ref, version, bt, dev, layout in _LAYOUT_CACHE:
        if ref() is cu_seqlens and version == cu_seqlens._version and bt == chunk_size and dev == str(device):
            return layout
    layout = _chunk_layout_varlen(chunk_size, cu_seqlens, device, cu_host)
    _LAYOUT_CACHE.insert(0, (weakref.ref(cu_seqlens), cu_seqlens._version, chunk_size, str(device), layout))
    del _LAYOUT_CACHE[4:]
    return layout


def _chunk_layout_varlen(chunk_size, cu_seqlens, device, cu_host=None):
    lens = [b - a for a, b in itertools.pairwise(cu_host if cu_host is not None else cu_seqlens.tolist())]
    per = [triton.cdiv(n, chunk_size) for n in lens]
    NT_all = sum(per)
    # one int32 host buffer [chunk_indices (2 * NT_all), padding to 16 bytes | chunk_offsets (N + 1)]: a
    # `torch.tensor(list, device="cuda")` is a blocking copy (it waits for the queue), pinned + non_blocking is not
    pad = -2 * NT_all % 4  # chunk_offsets stays 16-byte aligned, like a tensor of its own (Triton pointer hints)
    host = torch.tensor([v for n, m in enumerate(per) for c in range(m) for v in (n, c)] + [0] * pad
                        + [0, *itertools.accumulate(per)], dtype=torch.int32)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    dev_t = host.to(device, non_blocking=True)
    chunk_indices, chunk_offsets = dev_t[:2 * NT_all].view(NT_all, 2), dev_t[2 * NT_all + pad:]
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    return len(lens), 0, NT_all, chunk_indices, chunk_offsets, cu


def _layout_args(B, T, chunk_size, cu_seqlens, device, cu_host, placeholder):
    """chunk_layout with the varlen index tensors replaced by `placeholder` when there is no varlen (the kernels
    take them as arguments and ignore them under VARLEN=False)."""
    N, NT, NT_all, chunk_indices, chunk_offsets, cu = chunk_layout(B, T, chunk_size, cu_seqlens, device, cu_host)
    if cu_seqlens is None:
        chunk_indices = chunk_offsets = cu = placeholder
    return N, NT, NT_all, chunk_indices, chunk_offsets, cu
