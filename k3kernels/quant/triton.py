"""Fused int4 dequant GEMMs in Triton: the grouped one for routed experts and the dense one for linears.

    y[rows of e] = A(x[rows of e]) @ (q[e] * s[e]).T    q int4 [E, N, K] packed two per byte, s fp32 [E, N, K/g]

One kernel serves both (`DENSE`: a single weight, every row). Each program owns a BLOCK_M x BLOCK_N output tile
and walks K: it loads BLOCK_K/2 packed bytes per output row, splits each byte into its low nibble (even k) and
high nibble (odd k), sign-extends them, multiplies by the group scales in fp32 and casts to x's dtype, all in
registers, so no full-precision copy of a weight ever reaches memory. x is loaded as its even and odd columns, and
the tile accumulates dot(x_even, w_lo^T) + dot(x_odd, w_hi^T) in fp32 (the two halves of the K-reduction), which
avoids interleaving the nibbles. The next step's bytes and scales are loaded before this step's math, so the weight
stream never waits on one load at a time. At decode sizes (`swap`) the weight tile is the dot's left operand
(acc [BLOCK_N, BLOCK_M]): the out-features fill the tensor core's wide side and the few rows its narrow side.

A(x): identity for w4a16; for w4a8 (`A8`) the per-token FP8 e4m3 quantization of naive.fake_quant_fp8_per_token
inside the kernel: each row's absmax over K first, then e4m3(x / s) * s rounded by arithmetic, bit for bit the
fake quantizer's values (no separate pass over x, no FP8 tensor in memory).

Grouped tiles without a host sync (CUDA graphs): the grid has cdiv(M, BLOCK_M) + E row tiles, an upper bound of
sum_e cdiv(counts[e], BLOCK_M); each program reads counts [E], finds its expert from the running sum of the tiles
per expert, and tiles past the last expert's write nothing. The naive twins are naive.quant_grouped_mm_torch and
naive.quant_linear_torch (dequantize, then the matmul), which the tests compare against under TRITON_INTERPRET=1.

Legend: M rows of x, N out-features, K in-features, E experts, g group size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import INT4_FORMATS, quant_grouped_mm_torch, quant_linear_torch


class Launch(NamedTuple):
    """One launch configuration (benchmarks/quant_tune.py sweeps them on a GPU; `launch_for` picks one)."""

    swap: bool  # the weight tile as the dot's left operand (acc [BLOCK_N, BLOCK_M]): decode-sized row tiles
    block_m: int  # rows of x per program (>= 16, tl.dot's minimum)
    block_n: int  # out-features per program
    steps: int  # groups per K step (each group is its own dot, scaled after it)
    num_warps: int
    num_stages: int


# launch table (H200, benchmarks/quant_tune.py; RESULTS.md "Fused int4 GEMMs"): decode-sized tiles for up to 16 rows
# per expert, where the weight read is everything; larger row tiles where each dequantized weight tile is reused
DECODE = Launch(swap=True, block_m=16, block_n=128, steps=1, num_warps=4, num_stages=1)
PREFILL = Launch(swap=False, block_m=64, block_n=128, steps=1, num_warps=4, num_stages=3)
FP8_MAX = tl.constexpr(448.0)  # e4m3fn's largest finite value
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (t + MAGIC) - MAGIC rounds |t| < 2**22 to an integer, ties to even
FP8_ROWS = 16  # rows per program of the activation kernel


def launch_for(rows: int, experts: int) -> Launch:
    """The table's configuration for `rows` rows of x over `experts` weights (on the host: no device sync)."""
    return DECODE if rows <= 16 * experts else PREFILL


@triton.jit
def _e4m3_round(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3fn value, ties to even, by arithmetic: the spacing is
    2**(exponent - 3), at least 2**-9 (the subnormals), so v / spacing is exact and rounds to an integer."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 255) - 127, -6)
    spacing = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    t = v / spacing  # a power of two: exact
    return ((t + MAGIC) - MAGIC) * spacing


@triton.jit
def _fp8_rows_kernel(x_ptr, y_ptr, M, stride_xm, stride_ym, K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """w4a8's activations, y = e4m3(x / s) * s with s = absmax(row) / 448, as naive.fake_quant_fp8_per_token
    computes them (fp32 math, IEEE division, cast once): one pass for the absmax, one for the values."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = rows < M
    o_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for kb in range(0, K, BLOCK_K):
        mask = m_mask[:, None] & ((kb + o_k) < K)[None, :]
        xa = tl.load(x_ptr + rows[:, None] * stride_xm + (kb + o_k)[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(xa.to(tl.float32)), 1))
    s = amax / FP8_MAX
    safe = tl.where(s > 0, s, 1.0)[:, None]  # an all-zero row stays zero
    for kb in range(0, K, BLOCK_K):
        mask = m_mask[:, None] & ((kb + o_k) < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (kb + o_k)[None, :], mask=mask, other=0.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), safe), -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + rows[:, None] * stride_ym + (kb + o_k)[None, :], (_e4m3_round(v) * safe).to(x.dtype),
                 mask=mask)


@triton.jit
def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, counts_ptr, M, N, E,
                    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                    K: tl.constexpr, GROUP: tl.constexpr, DENSE: tl.constexpr, PREC: tl.constexpr,
                    SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DENSE:
        e = tl.full([], 0, tl.int32)
        tile0 = 0
        row0 = 0
        cnt = M
    else:
        o_e = tl.arange(0, BLOCK_E)
        c_E = tl.load(counts_ptr + o_e, mask=o_e < E, other=0).to(tl.int32)  # [BE] rows per expert
        tiles_E = (c_E + BLOCK_M - 1) // BLOCK_M
        end_E = tl.cumsum(tiles_E, 0)  # [BE] one past each expert's last tile
        e = tl.sum((end_E <= pid_m).to(tl.int32), 0)  # this tile's expert (>= E: past the last one)
        tile0 = tl.sum(tl.where(o_e < e, tiles_E, 0), 0)
        row0 = tl.sum(tl.where(o_e < e, c_E, 0), 0)
        cnt = tl.sum(tl.where(o_e == e, c_E, 0), 0)  # 0 past the last expert: every row masked
        e = tl.minimum(e, E - 1)
    GH: tl.constexpr = GROUP // 2  # packed bytes per group
    BK: tl.constexpr = STEPS * GROUP
    dt = x_ptr.dtype.element_ty
    # 16-bit x: a code's offset value u = q + 8 in [0, 15] becomes a float by its bits alone, OR-ed into the
    # mantissa of 128 (bf16, 7 mantissa bits) or 1024 (fp16, 10): no int-to-float conversions, which run at a
    # quarter of the ALU rate and would bound the kernel; the constant offset comes off after the dot
    MAGIC16: tl.constexpr = 0x4300 if dt == tl.bfloat16 else 0x6400
    OFFSET: tl.constexpr = 136.0 if dt == tl.bfloat16 else 1032.0  # the magic value of u = 0 plus the 8 of u
    local = (pid_m - tile0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows within the expert
    m_mask = local < tl.broadcast_to(cnt, [BLOCK_M])  # compared at the block's shape: a bool mask (conftest)
    rows = (row0 + local).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = (o_n < N) & (tl.broadcast_to(cnt, [BLOCK_N]) > 0)  # no weight traffic for a tile without rows
    w_row = w_ptr + e.to(tl.int64) * stride_we + o_n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    s_row = s_ptr + e.to(tl.int64) * stride_se + o_n.to(tl.int64) * stride_sn  # [BN]
    o_b = tl.arange(0, GH)
    o_k = tl.arange(0, GROUP)
    if SWAP:  # x tiles read transposed, [GROUP, BM]
        x_tile = x_ptr + rows[None, :] * stride_xm + o_k[:, None]
        x_mask = tl.broadcast_to(m_mask[None, :], [GROUP, BLOCK_M])
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_tile = x_ptr + rows[:, None] * stride_xm + o_k[None, :]
        x_mask = tl.broadcast_to(m_mask[:, None], [BLOCK_M, GROUP])
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, K, BK):
        for g in tl.static_range(STEPS):
            k0 = kb + g * GROUP
            # masks at the blocks' shapes (bool in the interpreter too): the tail step of a K that BK does not divide
            b_live = (k0 // 2 + o_b) < K // 2  # [GH]
            k_live = (k0 + o_k) < K  # [GROUP]
            byte = tl.load(w_row + (k0 // 2 + o_b)[None, :], mask=n_mask[:, None] & b_live[None, :], other=0)
            s = tl.load(s_row + k0 // GROUP, mask=n_mask & ((o_n * 0 + k0) < K), other=0.0)  # [BN] group scales
            live = k_live[:, None] if SWAP else k_live[None, :]
            x = tl.load(x_tile + k0, mask=x_mask & live, other=0.0)
            if dt == tl.float32:
                b = byte.to(tl.int32)
                w = tl.interleave(((b & 15) ^ 8) - 8, ((b >> 4) ^ 8) - 8).to(dt)  # [BN, GROUP] codes, k order
            else:
                b = byte.to(tl.int16)
                # the bits of OFFSET - 8 + u for u = q + 8, as a bf16 / fp16 [BN, GROUP] in k order
                w = tl.interleave(((b & 15) ^ 8) | MAGIC16, ((b >> 4) ^ 8) | MAGIC16).to(dt, bitcast=True)
            if SWAP:
                part = tl.dot(w, x, input_precision=PREC)  # [BN, BM]
                if dt != tl.float32:
                    part -= OFFSET * tl.sum(x.to(tl.float32), 0)[None, :]
                acc += part * s[:, None]
            else:
                part = tl.dot(x, tl.trans(w), input_precision=PREC)  # [BM, BN]
                if dt != tl.float32:
                    part -= OFFSET * tl.sum(x.to(tl.float32), 1)[:, None]
                acc += part * s[None, :]
    if SWAP:
        y_ptrs = y_ptr + rows[None, :] * stride_ym + o_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[None, :] & (o_n < N)[:, None])
    else:
        y_ptrs = y_ptr + rows[:, None] * stride_ym + o_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & (o_n < N)[None, :])


def fp8_rows_triton(x_MK: torch.Tensor) -> torch.Tensor:
    """naive.fake_quant_fp8_per_token on x [M, K] (fp32 / bf16 / fp16) in one launch, bit for bit."""
    x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    y = torch.empty_like(x_MK)
    if M:
        _fp8_rows_kernel[(triton.cdiv(M, FP8_ROWS),)](x_MK, y, M, x_MK.stride(0), y.stride(0), K=K, BLOCK_M=FP8_ROWS,
                                                      BLOCK_K=min(triton.next_power_of_2(K), 256))
    return y


def _check(fn: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int]:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{fn}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if qweight.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"{fn}: needs packed uint8 weights and fp32 scales, got {qweight.dtype}, {scales.dtype}")
    N, KH = qweight.shape[-2:]
    K, G = 2 * KH, scales.shape[-1]
    if x.shape[-1] != K or scales.shape[:-1] != qweight.shape[:-1] or G == 0 or K % G or (K // G) % 2:
        raise ValueError(f"{fn}: x [..., {x.shape[-1]}], weights {tuple(qweight.shape)} and scales "
                         f"{tuple(scales.shape)} disagree (x [..., K], weights [.., N, K/2], scales [.., N, K/g])")
    if K // G < 16 or (K // G) & (K // G - 1):
        raise ValueError(f"{fn}: group size {K // G} must be a power of two >= 16 (each group is one tensor-core "
                         "dot of K = group size)")
    check_device(fn, x, qweight, scales)
    return N, K, K // G


def _launch(x_MK: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, counts_E: torch.Tensor | None,
            N: int, K: int, group: int, a8: bool = False, config: Launch | None = None) -> torch.Tensor:
    M = x_MK.shape[0]
    y = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return y
    x_MK = fp8_rows_triton(x_MK) if a8 else x_MK.contiguous()
    dense = counts_E is None
    E = 1 if dense else qweight.shape[0]
    c = config or launch_for(M, E)
    rows = triton.cdiv(M, c.block_m) + (0 if dense else E)
    grid = (rows, triton.cdiv(N, c.block_n))
    w3 = qweight if qweight.dim() == 3 else qweight.unsqueeze(0)
    s3 = scales if scales.dim() == 3 else scales.unsqueeze(0)
    counts = x_MK if dense else counts_E  # unread when DENSE
    _w4_gemm_kernel[grid](
        x_MK, w3, s3, y, counts, M, N, E, x_MK.stride(0), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1),
        y.stride(0), K=K, GROUP=group, DENSE=dense, PREC="ieee" if x_MK.dtype == torch.float32 else "tf32",
        SWAP=c.swap, BLOCK_M=c.block_m, BLOCK_N=c.block_n, STEPS=c.steps, BLOCK_E=triton.next_power_of_2(E),
        num_warps=c.num_warps, num_stages=c.num_stages)
    return y


def w4_grouped_mm_triton(x_MK: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, counts_E: torch.Tensor,
                         a8: bool = False, config: Launch | None = None) -> torch.Tensor:
    """Fused grouped GEMM on int4 expert weights: x_MK [M, K] rows grouped by expert, qweight uint8 [E, N, K/2],
    scales fp32 [E, N, K/g], counts_E [E] -> y_MN [M, N] in x's dtype (fp32 accumulation). a8: x gets w4a8's
    per-token FP8 e4m3 quantization inside the kernel (fake_quant_fp8_per_token's values); config: a Launch
    instead of the table's.

    Example: y = w4_grouped_mm_triton(x_MK, experts.gate_up_proj, experts.gate_up_proj_scales, counts_E)
    """
    if x_MK.dim() != 2 or qweight.dim() != 3 or counts_E.numel() != qweight.shape[0]:
        raise ValueError(f"w4_grouped_mm_triton expects x [M, K], weights [E, N, K/2], counts [E]; got "
                         f"{tuple(x_MK.shape)}, {tuple(qweight.shape)}, {tuple(counts_E.shape)}")
    N, K, group = _check("w4_grouped_mm_triton", x_MK, qweight, scales)
    return _launch(x_MK, qweight, scales, counts_E, N, K, group, a8, config)


def w4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, a8: bool = False,
                     config: Launch | None = None) -> torch.Tensor:
    """Fused dense int4 GEMM: x [..., K], qweight uint8 [N, K/2], scales fp32 [N, K/g] -> y [..., N] in x's dtype
    (a8, config as in w4_grouped_mm_triton).

    Example: logits = w4_linear_triton(h_BTD, head.weight, head.weight_scales)
    """
    if qweight.dim() != 2:
        raise ValueError(f"w4_linear_triton expects weights [N, K/2], got {tuple(qweight.shape)}")
    N, K, group = _check("w4_linear_triton", x, qweight, scales)
    y = _launch(x.reshape(-1, K), qweight, scales, None, N, K, group, a8, config)
    return y.view(*x.shape[:-1], N)


def _fused(x: torch.Tensor) -> bool:
    # float64 references run the twin (k3kernels/README.md); the kernel's dots take fp32 / bf16 / fp16
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def quant_grouped_mm_triton(x_MI: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            counts_E: torch.Tensor, fmt: str, impl: str = "auto") -> torch.Tensor:
    """The triton backend's `quant_grouped_mm`: int4 formats through the fused kernel (w4a8's per-token FP8
    activations inside it), w8a16 and float64 through the twin."""
    if fmt not in INT4_FORMATS or not _fused(x_MI):
        return quant_grouped_mm_torch(x_MI, qweight, scales, counts_E, fmt, impl)
    return w4_grouped_mm_triton(x_MI, qweight, scales, counts_E, a8=fmt == "w4a8")


def quant_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The triton backend's `quant_linear`: int4 formats through the fused dense kernel, the rest through the twin."""
    if fmt not in INT4_FORMATS or not _fused(x):
        return quant_linear_torch(x, qweight, scales, fmt)
    return w4_linear_triton(x, qweight, scales, a8=fmt == "w4a8")
