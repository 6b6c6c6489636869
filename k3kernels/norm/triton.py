"""Fused gated RMSNorm in Triton: one pass forward, one backward (do, dgate, dweight), fp32 math inside.

Legend: R rows (every leading dimension flattened: tokens x heads), V the normalised dimension, BV = next_pow2(V),
BR rows per program, s = sigmoid(gate).

    r = rsqrt(mean_V(o^2) + eps),   n = o r,   y = n w s
    dgate = dy n w s (1 - s)        dweight = sum_R dy n s        dn = dy w s
    do = r (dn - n mean_V(dn n))                                   (the chain rule through r: dr/do = -r^3 o / V)

The backward recomputes r and s from the saved o and gate (nothing else is kept) and writes fp32 dweight partial sums
per program, summed once afterwards (deterministic). o, gate and y keep their own dtypes; the PyTorch twin is
`k3.kernels.norm.naive.gated_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import gated_rms_norm

MAX_V = 8192  # one program holds whole rows; wider rows would spill (the twin serves them)
ROW_ELEMENTS = 4096  # elements per program (BR rows of BV): enough work per launch slot, few registers per thread
NUM_WARPS = 4


@triton.jit
def _gated_norm_fwd_kernel(o, g, w, y, R, eps, V: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    d = tl.arange(0, BV)  # [BV]
    m = (rows < R)[:, None] & (d < V)[None, :]
    p = rows[:, None] * V + d[None, :]
    b_o = tl.load(o + p, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + p, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + d, mask=d < V, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_o * b_o, axis=1) / V + tl.full([], eps, tl.float32))  # [BR]; eps fp64 under inductor
    b_y = b_o * r[:, None] * b_w[None, :] * tl.sigmoid(b_g)
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def _gated_norm_bwd_kernel(o, g, w, dy, do, dg, dw_part, R, eps, V: tl.constexpr, BV: tl.constexpr,
                           BR: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    d = tl.arange(0, BV)  # [BV]
    m = (rows < R)[:, None] & (d < V)[None, :]
    p = rows[:, None] * V + d[None, :]
    b_o = tl.load(o + p, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + p, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + d, mask=d < V, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_o * b_o, axis=1) / V + tl.full([], eps, tl.float32))  # [BR]
    n = b_o * r[:, None]
    s = tl.sigmoid(b_g)
    dys = b_dy * s
    tl.store(dg + p, (b_dy * n * b_w[None, :] * s * (1.0 - s)).to(dg.dtype.element_ty), mask=m)
    dn = dys * b_w[None, :]
    b_do = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / V)[:, None])
    tl.store(do + p, b_do.to(do.dtype.element_ty), mask=m)
    tl.store(dw_part + pid.to(tl.int64) * V + d, tl.sum(dys * n, axis=0), mask=d < V)


def _blocks(V: int) -> tuple[int, int]:
    BV = triton.next_power_of_2(V)
    return BV, max(1, min(64, ROW_ELEMENTS // BV))


def _fwd(o2, g2, w, eps):
    """o2, g2 [R, V] contiguous, w [V] -> y [R, V] in o2's dtype."""
    R, V = o2.shape
    y = torch.empty_like(o2)
    if y.numel():
        BV, BR = _blocks(V)
        _gated_norm_fwd_kernel[(triton.cdiv(R, BR),)](o2, g2, w, y, R, float(eps), V=V, BV=BV, BR=BR,
                                                      num_warps=NUM_WARPS)
    return y


def _bwd(o2, g2, w, dy2, eps):
    """-> (do [R, V] in o's dtype, dgate [R, V] in gate's dtype, dweight [V] in w's dtype)."""
    R, V = o2.shape
    BV, BR = _blocks(V)
    grid = (triton.cdiv(R, BR),)
    do, dg = torch.empty_like(o2), torch.empty_like(g2)
    parts = torch.empty(grid[0], V, dtype=torch.float32, device=o2.device)  # [programs, V]
    if do.numel():
        _gated_norm_bwd_kernel[grid](o2, g2, w, dy2, do, dg, parts, R, float(eps), V=V, BV=BV, BR=BR,
                                     num_warps=NUM_WARPS)
    return do, dg, parts.sum(0).to(w.dtype)


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
