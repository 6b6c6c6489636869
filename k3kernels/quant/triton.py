"""Fused int4 dequant GEMMs in Triton: the grouped one for routed experts and the dense one for linears.

    y[rows of e] = x[rows of e] @ (q[e] * s[e]).T        q int4 [E, N, K] packed two per byte, s fp32 [E, N, K/g]

One kernel serves both (`DENSE`: a single weight, every row). Each program owns a BLOCK_M x BLOCK_N output tile
and walks K: it loads BLOCK_K/2 packed bytes per output row, splits each byte into its low nibble (even k) and
high nibble (odd k), sign-extends them, multiplies by the group scales in fp32 and casts to x's dtype, all in
registers, so no full-precision copy of a weight ever reaches memory. x is loaded as its even and odd columns, and
the tile accumulates dot(x_even, w_lo^T) + dot(x_odd, w_hi^T) in fp32 (the two halves of the K-reduction), which
avoids interleaving the nibbles.

Grouped tiles without a host sync (CUDA graphs): the grid has cdiv(M, BLOCK_M) + E row tiles, an upper bound of
sum_e cdiv(counts[e], BLOCK_M); each program reads counts [E], finds its expert from the running sum of the tiles
per expert, and tiles past the last expert's write nothing. The naive twins are naive.quant_grouped_mm_torch and
naive.quant_linear_torch (dequantize, then the matmul), which the tests compare against under TRITON_INTERPRET=1.

Legend: M rows of x, N out-features, K in-features, E experts, g group size, KH = K / 2 packed bytes per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import INT4_FORMATS, quant_grouped_mm_torch, quant_linear_torch, quantize_activations

# launch table (one comment per knob)
BLOCK_N = 64  # out-features per program: 64 x BLOCK_K/2 bytes of weight per K step, enough to keep loads wide
BLOCK_K = 128  # in-features per K step: a whole number of groups (g <= 128) and 64 bytes per weight row
SMALL_M = 16  # row tile when rows per expert are decode-sized (tl.dot needs >= 16); the weight read dominates
LARGE_M = 64  # row tile for prefill-sized groups, where reuse of each dequantized weight tile pays
NUM_WARPS = 4  # one 64-wide N tile; more warps only add reduction overhead at these tile sizes


@triton.jit
def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, counts_ptr, M, N, E,
                    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                    K: tl.constexpr, GROUP: tl.constexpr, DENSE: tl.constexpr, PREC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
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
    KH: tl.constexpr = K // 2
    BKH: tl.constexpr = BLOCK_K // 2
    GH: tl.constexpr = GROUP // 2  # packed bytes per group
    NG: tl.constexpr = BLOCK_K // GROUP  # groups per K step
    local = (pid_m - tile0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows within the expert
    m_mask = local < tl.broadcast_to(cnt, [BLOCK_M])  # compared at the block's shape: a bool mask (conftest)
    rows = (row0 + local).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = (o_n < N) & (tl.broadcast_to(cnt, [BLOCK_N]) > 0)  # no weight traffic for a tile without rows
    w_row = w_ptr + e.to(tl.int64) * stride_we + o_n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    s_row = s_ptr + e.to(tl.int64) * stride_se + o_n.to(tl.int64)[:, None] * stride_sn
    x_row = x_ptr + rows[:, None] * stride_xm  # [BM, 1]
    o_b = tl.arange(0, BKH)  # [BKH] bytes of one K step
    o_g = tl.arange(0, NG)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, KH, BKH):
        b_mask = (kb + o_b) < KH  # [BKH] the tail step of a K that BLOCK_K does not divide
        byte = tl.load(w_row + (kb + o_b)[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0).to(tl.int32)
        lo = ((byte & 15) ^ 8) - 8  # [BN, BKH] sign-extended nibbles: even k
        hi = ((byte >> 4) ^ 8) - 8  # odd k
        g_mask = (kb // GH + o_g) < (K // GROUP)
        s = tl.load(s_row + (kb // GH + o_g)[None, :], mask=n_mask[:, None] & g_mask[None, :], other=0.0)  # [BN, NG]
        s3 = s.to(tl.float32)[:, :, None]
        w_lo = tl.reshape(tl.reshape(lo.to(tl.float32), [BLOCK_N, NG, GH]) * s3, [BLOCK_N, BKH])
        w_hi = tl.reshape(tl.reshape(hi.to(tl.float32), [BLOCK_N, NG, GH]) * s3, [BLOCK_N, BKH])
        k_even = 2 * (kb + o_b)
        x_mask = m_mask[:, None] & b_mask[None, :]
        x_lo = tl.load(x_row + k_even[None, :], mask=x_mask, other=0.0)  # [BM, BKH]
        x_hi = tl.load(x_row + (k_even + 1)[None, :], mask=x_mask, other=0.0)
        dt = x_lo.dtype
        acc += tl.dot(x_lo, tl.trans(w_lo.to(dt)), input_precision=PREC)
        acc += tl.dot(x_hi, tl.trans(w_hi.to(dt)), input_precision=PREC)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + o_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & (o_n < N)[None, :])


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
    if BLOCK_K % (K // G):
        raise ValueError(f"{fn}: group size {K // G} must divide BLOCK_K = {BLOCK_K}")
    check_device(fn, x, qweight, scales)
    return N, K, K // G


def _launch(x_MK: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, counts_E: torch.Tensor | None,
            N: int, K: int, group: int) -> torch.Tensor:
    M = x_MK.shape[0]
    y = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return y
    x_MK = x_MK.contiguous()
    dense = counts_E is None
    E = 1 if dense else qweight.shape[0]
    block_m = SMALL_M if M <= SMALL_M * E else LARGE_M
    rows = triton.cdiv(M, block_m) + (0 if dense else E)
    grid = (rows, triton.cdiv(N, BLOCK_N))
    w3 = qweight if qweight.dim() == 3 else qweight.unsqueeze(0)
    s3 = scales if scales.dim() == 3 else scales.unsqueeze(0)
    counts = x_MK if dense else counts_E  # unread when DENSE
    _w4_gemm_kernel[grid](
        x_MK, w3, s3, y, counts, M, N, E, x_MK.stride(0), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1),
        y.stride(0), K=K, GROUP=group, DENSE=dense, PREC="ieee" if x_MK.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_E=triton.next_power_of_2(E), num_warps=NUM_WARPS)
    return y


def w4_grouped_mm_triton(x_MK: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         counts_E: torch.Tensor) -> torch.Tensor:
    """Fused grouped GEMM on int4 expert weights: x_MK [M, K] rows grouped by expert, qweight uint8 [E, N, K/2],
    scales fp32 [E, N, K/g], counts_E [E] -> y_MN [M, N] in x's dtype (fp32 accumulation).

    Example: y = w4_grouped_mm_triton(x_MK, experts.gate_up_proj, experts.gate_up_proj_scales, counts_E)
    """
    if x_MK.dim() != 2 or qweight.dim() != 3 or counts_E.numel() != qweight.shape[0]:
        raise ValueError(f"w4_grouped_mm_triton expects x [M, K], weights [E, N, K/2], counts [E]; got "
                         f"{tuple(x_MK.shape)}, {tuple(qweight.shape)}, {tuple(counts_E.shape)}")
    N, K, group = _check("w4_grouped_mm_triton", x_MK, qweight, scales)
    return _launch(x_MK, qweight, scales, counts_E, N, K, group)


def w4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Fused dense W4A16 GEMM: x [..., K], qweight uint8 [N, K/2], scales fp32 [N, K/g] -> y [..., N] in x's dtype.

    Example: logits = w4_linear_triton(h_BTD, head.weight, head.weight_scales)
    """
    if qweight.dim() != 2:
        raise ValueError(f"w4_linear_triton expects weights [N, K/2], got {tuple(qweight.shape)}")
    N, K, group = _check("w4_linear_triton", x, qweight, scales)
    y = _launch(x.reshape(-1, K), qweight, scales, None, N, K, group)
    return y.view(*x.shape[:-1], N)


def _fused(x: torch.Tensor) -> bool:
    # float64 references run the twin (k3kernels/README.md); the kernel's dots take fp32 / bf16 / fp16
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def quant_grouped_mm_triton(x_MI: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            counts_E: torch.Tensor, fmt: str, impl: str = "auto") -> torch.Tensor:
    """The triton backend's `quant_grouped_mm`: int4 formats through the fused kernel (w4a8's per-token FP8
    activations quantized first), w8a16 and float64 through the twin."""
    if fmt not in INT4_FORMATS or not _fused(x_MI):
        return quant_grouped_mm_torch(x_MI, qweight, scales, counts_E, fmt, impl)
    return w4_grouped_mm_triton(quantize_activations(x_MI, fmt), qweight, scales, counts_E)


def quant_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The triton backend's `quant_linear`: int4 formats through the fused dense kernel, the rest through the twin."""
    if fmt not in INT4_FORMATS or not _fused(x):
        return quant_linear_torch(x, qweight, scales, fmt)
    return w4_linear_triton(quantize_activations(x, fmt), qweight, scales)
