"""Fused C2-GLU (architecture.md section 8) in Triton: one elementwise pass forward, one backward, fp32 math inside.

    h = A(g) * B(u),   A(g) = b1 tanh(g / b1) sigmoid(g),   B(u) = b2 tanh(u / b2)              |h| < b1 b2
    dA/dg = sech^2(g / b1) sigmoid(g) + b1 tanh(g / b1) sigmoid(g) sigmoid(-g)
    dB/du = sech^2(u / b2)

The naive twin is `k3.kernels.glu.naive.c2_glu`. The backward recomputes A, B from the inputs (nothing is saved
but the inputs), so the fused op stores no [N, m] intermediate.

Legend: N rows (tokens, flattened leading dims), m the hidden width (one half of a packed [gate | up] row).
Shapes: gate_up [..., 2m] -> h [..., m]; or gate, up [..., m] -> h [..., m]. Output in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import c2_glu, c2_glu_packed

BLOCK_N = 16
BLOCK_M = 128


@triton.jit
def _tanh_sech2(x):
    """(tanh(x), sech^2(x)) in fp32, without overflow and without cancellation near 0.

    e = exp(-2|x|) in (0, 1]: tanh|x| = (1 - e) / (1 + e), sech^2 x = 4 e / (1 + e)^2 (never 1 - tanh^2, which is
    exactly 0 in fp32 for |x| > ~9). For |x| < 0.25, 1 - e loses digits, so tanh uses its Taylor series
    x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 (truncation < 1e-8 relative there).
    """
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t_big = (1.0 - e) / (1.0 + e)
    t_big = tl.where(x < 0, -t_big, t_big)
    x2 = x * x
    t_small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < 0.25, t_small, t_big)
    sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return t, sech2


@triton.jit
def _sigmoid_pair(x):
    """(sigmoid(x), sigmoid(-x)) from one exp(-|x|), which never overflows."""
    e = tl.exp(-tl.abs(x))
    p = 1.0 / (1.0 + e)
    q = e / (1.0 + e)
    return tl.where(x >= 0, p, q), tl.where(x >= 0, q, p)


@triton.jit
def _c2_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, N, M, stride_g, stride_u, stride_h, beta1, beta2,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    mask = (rows[:, None] < N) & (cols[None, :] < M)  # [BN, BM]
    r64 = rows.to(tl.int64)[:, None]
    beta1, beta2 = tl.full([], beta1, tl.float32), tl.full([], beta2, tl.float32)  # fp64 when launched by inductor (torch.compile)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tg, _ = _tanh_sech2(g / beta1)
    tu, _ = _tanh_sech2(u / beta2)
    sg, _ = _sigmoid_pair(g)
    h = (beta1 * tg * sg) * (beta2 * tu)
    tl.store(h_ptr + r64 * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _c2_glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, N, M, stride_g, stride_u, stride_dh, stride_dg,
                       stride_du, beta1, beta2, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    mask = (rows[:, None] < N) & (cols[None, :] < M)  # [BN, BM]
    r64 = rows.to(tl.int64)[:, None]
    beta1, beta2 = tl.full([], beta1, tl.float32), tl.full([], beta2, tl.float32)  # fp64 when launched by inductor (torch.compile)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tg, sech2_g = _tanh_sech2(g / beta1)
    tu, sech2_u = _tanh_sech2(u / beta2)
    sg, sng = _sigmoid_pair(g)  # sng = 1 - sigmoid(g) without cancellation for large g
    a = beta1 * tg * sg
    b = beta2 * tu
    da = sech2_g * sg + beta1 * tg * sg * sng
    tl.store(dg_ptr + r64 * stride_dg + cols[None, :], (dh * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r64 * stride_du + cols[None, :], (dh * a * sech2_u).to(du_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., m] -> [N, m] with unit column stride (a view when possible, e.g. a half of a contiguous packed row)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]:
        x2 = x2.contiguous()
    return x2


def _grid(n: int, m: int):
    return (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))


def _fwd(g2: torch.Tensor, u2: torch.Tensor, betas: tuple[float, float]) -> torch.Tensor:
    """g2, u2 [N, m] (unit column stride) -> h [N, m] in g2's dtype."""
    n, m = g2.shape
    h = torch.empty((n, m), dtype=g2.dtype, device=g2.device)
    if h.numel():
        _c2_glu_fwd_kernel[_grid(n, m)](g2, u2, h, n, m, g2.stride(0), u2.stride(0), h.stride(0), *betas,
                                        BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M)
    return h


def _bwd(g2: torch.Tensor, u2: torch.Tensor, dh2: torch.Tensor, betas: tuple[float, float]) -> torch.Tensor:
    """g2, u2, dh2 [N, m] -> d gate_up [N, 2m] packed [d gate | d up] (one allocation, one kernel)."""
    n, m = g2.shape
    dgu = torch.empty((n, 2 * m), dtype=g2.dtype, device=g2.device)
    dg, du = dgu[:, :m], dgu[:, m:]
    if dgu.numel():
        _c2_glu_bwd_kernel[_grid(n, m)](g2, u2, dh2, dg, du, n, m, g2.stride(0), u2.stride(0), dh2.stride(0),
                                        dg.stride(0), du.stride(0), *betas, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M)
    return dgu


class _C2GLUPacked(torch.autograd.Function):
    """gate_up [..., 2m] -> h [..., m]; the gradient arrives as one packed [..., 2m] tensor (no slice copies)."""

    @staticmethod
    def forward(ctx, gate_up, beta1, beta2):
        m = gate_up.shape[-1] // 2
        gu2 = _rows(gate_up)  # [N, 2m]
        ctx.betas, ctx.shape = (float(beta1), float(beta2)), gate_up.shape
        ctx.save_for_backward(gu2)
        return _fwd(gu2[:, :m], gu2[:, m:], ctx.betas).view(*gate_up.shape[:-1], m)

    @staticmethod
    def backward(ctx, dh):
        (gu2,) = ctx.saved_tensors
        m = gu2.shape[1] // 2
        return _bwd(gu2[:, :m], gu2[:, m:], _rows(dh), ctx.betas).view(ctx.shape), None, None


class _C2GLUSplit(torch.autograd.Function):
    """gate, up [..., m] -> h [..., m]; d gate and d up are the halves of one packed buffer."""

    @staticmethod
    def forward(ctx, gate, up, beta1, beta2):
        g2, u2 = _rows(gate), _rows(up)
        ctx.betas, ctx.shape = (float(beta1), float(beta2)), gate.shape
        ctx.save_for_backward(g2, u2)
        return _fwd(g2, u2, ctx.betas).view(gate.shape)

    @staticmethod
    def backward(ctx, dh):
        g2, u2 = ctx.saved_tensors
        m = g2.shape[1]
        dgu = _bwd(g2, u2, _rows(dh), ctx.betas)
        return dgu[:, :m].view(ctx.shape), dgu[:, m:].view(ctx.shape), None, None


def _check(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"c2_glu_triton: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"c2_glu_triton: gate ({gate.dtype}) and up ({up.dtype}) must share a dtype; cast one")
    if gate.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"c2_glu_triton takes fp32/bf16/fp16 inputs, got {gate.dtype}; use k3.kernels.glu.naive."
                         "c2_glu for float64 references")
    if not (beta1 > 0 and beta2 > 0):
        raise ValueError(f"c2_glu_triton needs beta1, beta2 > 0, got {beta1}, {beta2}")


def c2_glu_split_triton(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """C2-GLU on separate halves. gate, up: [..., m] (same shape and dtype) -> h [..., m] in that dtype.

    Differentiable (Triton backward). gate/up may be the two halves of a packed [..., 2m] tensor (views, no copy).
    Example: h = c2_glu_split_triton(*gu.split(m, -1))
    """
    _check(gate, up, beta1, beta2)
    return _C2GLUSplit.apply(gate, up, beta1, beta2)


def c2_glu_triton(gate_up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """C2-GLU on a packed projection. gate_up: [..., 2m] laid out [gate | up] -> h [..., m] in gate_up's dtype.

    Differentiable: the gradient d gate_up [..., 2m] comes from one Triton kernel (fp32 math).
    Example: h = c2_glu_triton(x @ w_gate_up.T, 4.0, 25.0)
    """
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"c2_glu_triton expects a packed [..., 2m] [gate | up] tensor with an even last dim, got "
                         f"{tuple(gate_up.shape)}; pass the halves to c2_glu_split_triton instead")
    m = gate_up.shape[-1] // 2
    _check(gate_up[..., :m], gate_up[..., m:], beta1, beta2)
    return _C2GLUPacked.apply(gate_up, beta1, beta2)


def c2_glu_dispatch(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """`c2_glu` on the "triton" backend: the fused kernel for same-shape, same-dtype fp32/bf16/fp16 halves on the
    GPU (or the CPU interpreter); float64 and mixed-dtype calls stay on the PyTorch twin (same formula)."""
    if gate.dtype == torch.float64 or gate.dtype != up.dtype or gate.shape != up.shape:
        return c2_glu(gate, up, beta1, beta2)
    check_device("c2_glu", gate, up)
    return c2_glu_split_triton(gate, up, beta1, beta2)


def c2_glu_packed_dispatch(gate_up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """`c2_glu_packed` on the "triton" backend: the packed kernel for fp32/bf16/fp16 (its gradient one [..., 2m]
    buffer), the PyTorch twin for float64."""
    if gate_up.dtype == torch.float64:
        return c2_glu_packed(gate_up, beta1, beta2)
    check_device("c2_glu", gate_up)
    return c2_glu_triton(gate_up, beta1, beta2)
