"""Fused RMSNorms in Triton, gated (KDA's output norm) and plain (the model's RMSNorm): one pass forward, one
backward (dx, dgate, dweight), fp32 math inside, inputs and outputs in their own dtypes.

Legend: R rows (every leading dimension flattened), V the normalised dimension, BV = next_pow2(V), BR rows per
block, TILES row blocks per backward program, s = sigmoid(gate) (1 for the plain norm).

    r = rsqrt(mean_V(x^2) + eps),   n = x r,   y = n w s
    dgate = dy n w s (1 - s)        dweight = sum_R dy n s        dn = dy w s
    dx = r (dn - n mean_V(dn n))                                   (the chain rule through r: dr/dx = -r^3 x / V)

The backward recomputes r and s from the saved x and gate (nothing else is kept); each program walks TILES row
blocks and writes one fp32 dweight partial sum, summed once afterwards (deterministic). The PyTorch twins are
`k3.kernels.norm.naive.gated_rms_norm` and `k3.kernels.norm.naive.rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import gated_rms_norm, rms_norm

MAX_V = 8192  # one program holds whole rows; wider rows would spill (the twin serves them)
ROW_ELEMENTS = 4096  # elements per row block (BR rows of BV): enough work per launch slot, few registers per thread
NUM_WARPS = 4
BWD_PROGRAMS = 1024  # backward programs to aim for: every SM busy, few dweight partials ([programs, V] fp32)


@triton.jit
def _norm_fwd_kernel(x, g, w, y, R, eps, V: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
                     GATE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    d = tl.arange(0, BV)  # [BV]
    m = (rows < R)[:, None] & (d < V)[None, :]
    p = rows[:, None] * V + d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + d, mask=d < V, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / V + tl.full([], eps, tl.float32))  # [BR]; eps fp64 under inductor
    b_y = b_x * r[:, None] * b_w[None, :]
    if GATE:
        b_y = b_y * tl.sigmoid(tl.load(g + p, mask=m, other=0.0).to(tl.float32))
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def _norm_bwd_kernel(x, g, w, dy, dx, dg, dw_part, R, eps, V: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
                     TILES: tl.constexpr, GATE: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BV)  # [BV]
    b_w = tl.load(w + d, mask=d < V, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BV], dtype=tl.float32)
    for t in range(TILES):
        rows = (pid.to(tl.int64) * TILES + t) * BR + tl.arange(0, BR)  # [BR]
        m = (rows < R)[:, None] & (d < V)[None, :]
        p = rows[:, None] * V + d[None, :]
        b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / V + tl.full([], eps, tl.float32))  # [BR]
        n = b_x * r[:, None]
        if GATE:
            s = tl.sigmoid(tl.load(g + p, mask=m, other=0.0).to(tl.float32))
            tl.store(dg + p, (b_dy * n * b_w[None, :] * s * (1.0 - s)).to(dg.dtype.element_ty), mask=m)
            b_dy = b_dy * s
        dn = b_dy * b_w[None, :]
        b_dx = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / V)[:, None])
        tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)
        b_dw += tl.sum(b_dy * n, axis=0)
    tl.store(dw_part + pid.to(tl.int64) * V + d, b_dw, mask=d < V)


def _blocks(V: int) -> tuple[int, int]:
    BV = triton.next_power_of_2(V)
    return BV, max(1, min(64, ROW_ELEMENTS // BV))


def _tiles(R: int, BR: int) -> int:
    """Row blocks per backward program: a power of two (few compiled variants) leaving ~BWD_PROGRAMS programs."""
    return triton.next_power_of_2(max(1, triton.cdiv(triton.cdiv(R, BR), BWD_PROGRAMS)))


def _fwd(x2, g2, w, eps):
    """x2 [R, V] contiguous, g2 [R, V] or None, w [V] -> y [R, V] in x2's dtype."""
    R, V = x2.shape
    y = torch.empty_like(x2)
    if y.numel():
        BV, BR = _blocks(V)
        _norm_fwd_kernel[(triton.cdiv(R, BR),)](x2, x2 if g2 is None else g2, w, y, R, float(eps), V=V, BV=BV,
                                                BR=BR, GATE=g2 is not None, num_warps=NUM_WARPS)
    return y


def _bwd(x2, g2, w, dy2, eps):
    """-> (dx [R, V] in x's dtype, dgate [R, V] in gate's dtype or None, dweight [V] in w's dtype)."""
    R, V = x2.shape
    BV, BR = _blocks(V)
    tiles = _tiles(R, BR)
    grid = (triton.cdiv(R, BR * tiles),)
    dx = torch.empty_like(x2)
    dg = None if g2 is None else torch.empty_like(g2)
    parts = torch.empty(grid[0], V, dtype=torch.float32, device=x2.device)  # [programs, V]
    if dx.numel():
        _norm_bwd_kernel[grid](x2, x2 if g2 is None else g2, w, dy2, dx, dx if dg is None else dg, parts, R,
                               float(eps), V=V, BV=BV, BR=BR, TILES=tiles, GATE=g2 is not None,
                               num_warps=NUM_WARPS)
    return dx, dg, parts.sum(0).to(w.dtype)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, gate, weight, eps):
        V = o.shape[-1]
        o2, g2, w = o.reshape(-1, V).contiguous(), gate.reshape(-1, V).contiguous(), weight.contiguous()
        ctx.eps, ctx.shapes = eps, (o.shape, gate.shape)
        ctx.save_for_backward(o2, g2, w)
        return _fwd(o2, g2, w, eps).view(o.shape)

    @staticmethod
    def backward(ctx, dy):
        o2, g2, w = ctx.saved_tensors
        do, dg, dw = _bwd(o2, g2, w, dy.reshape(o2.shape).contiguous(), ctx.eps)
        return do.view(ctx.shapes[0]), dg.view(ctx.shapes[1]), dw, None


def gated_rms_norm_triton(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                          eps: float = 1e-5) -> torch.Tensor:
    """`gated_rms_norm` on the "triton" backend: the fused kernel for fp32 / bf16 / fp16 o and gate of one shape
    [..., V] (V <= MAX_V) and weight [V]; float64 and other shapes run the PyTorch twin (same formula).

    Example: y = gated_rms_norm_triton(o_BTHV, gate_BTHV, weight_V)
    """
    V = o.shape[-1]
    if gate.shape != o.shape or tuple(weight.shape) != (V,):
        raise ValueError(f"gated_rms_norm: o {tuple(o.shape)} and gate {tuple(gate.shape)} must share a shape "
                         f"[..., V] and weight {tuple(weight.shape)} must be [V={V}]")
    if torch.float64 in (o.dtype, gate.dtype) or V > MAX_V:
        return gated_rms_norm(o, gate, weight, eps)
    check_device("gated_rms_norm", o, gate, weight)
    return _GatedRMSNorm.apply(o, gate, weight, float(eps))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        V = x.shape[-1]
        x2, w = x.reshape(-1, V).contiguous(), weight.contiguous()
        ctx.eps, ctx.shape = eps, x.shape
        ctx.save_for_backward(x2, w)
        return _fwd(x2, None, w, eps).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dx, _, dw = _bwd(x2, None, w, dy.reshape(x2.shape).contiguous(), ctx.eps)
        return dx.view(ctx.shape), dw, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`rms_norm` on the "triton" backend, for training: the fused kernel (bf16 in, bf16 out, no fp32 copies of the
    activations either way) when autograd records x or the weight; the PyTorch twin (`F.rms_norm`, one fused CUDA
    kernel) under no_grad, for float64, V > MAX_V and inside torch.compile, so that inference and the compiled
    decode keep tracing one aten op.

    Example: y = rms_norm_triton(x_BTD, norm.weight, 1e-5)
    """
    V = x.shape[-1]
    if tuple(weight.shape) != (V,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be [V={V}] for x {tuple(x.shape)}")
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not grad or torch.float64 in (x.dtype, weight.dtype) or V > MAX_V or torch.compiler.is_compiling():
        return rms_norm(x, weight, eps)
    check_device("rms_norm", x, weight)
    return _RMSNorm.apply(x, weight, float(eps))
