"""Row-wise L2 normalisation as one Triton pass forward and one backward (the q/k L2 norm of `chunk_kda` with
`use_qk_l2norm_in_kernel=True` on the "triton" backend). PyTorch twin: `k3.kernels.kda.gate.l2norm`.

Legend: R rows (every leading dimension flattened), D the normalised (last) dimension, BD = next_pow2(D),
BR rows per program.

    y = x r,  r = (sum_d x_d^2 + eps)^(-1/2)                          (fp32 inside, y stored in x's dtype)
    dx = r (dy - y sum_d(dy_d y_d))                                  (chain rule through r: dr/dx = -r^3 x)

The eager PyTorch form (`l2norm(x.float()).to(dtype)` under autograd) costs about eight full passes over an fp32
copy of q and k per forward + backward; this costs one read and one write each way. The backward recomputes y from
the saved x and r instead of saving y (one tensor fewer kept alive).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gate import L2NORM_EPS
from .common import _f32


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, R, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                       STORE_Y: tl.constexpr):
    # STORE_Y False: rstd alone (a consumer scales the rows itself: l2norm_fwd's store_y)
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + _f32(eps))  # [BR]; eps is fp64 when inductor launches us
    if STORE_Y:
        tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=o_r < R)


@triton.jit
def _l2norm_bwd_kernel(x, rstd, dy, dx, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                       FROM_Y: tl.constexpr):
    # FROM_Y: `x` holds y itself (l2norm_bwd_from_y), else the input x (y recomputed as x r)
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_r = tl.load(rstd + o_r, mask=o_r < R, other=0.0)
    b_y = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    if not FROM_Y:
        b_y = b_y * b_r[:, None]
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


def _rows_per_program(D: int) -> int:
    """About 4K elements per program: enough work per launch slot, few registers per thread."""
    return max(1, min(64, 4096 // triton.next_power_of_2(D)))


def l2norm_fwd(x: torch.Tensor, eps: float = L2NORM_EPS, store_y: bool = True) -> tuple[torch.Tensor | None,
                                                                                         torch.Tensor]:
    """(y [..., D] in x's dtype, rstd [R] fp32, R = x.numel() / D): the forward pass without autograd, for callers
    that run the backward themselves (kda/chunk.py's _ChunkKDATriton: l2norm_bwd_from_y, or fused into the backward
    intra kernel). store_y False: (None, rstd), one read of x and no write of y, for a consumer that scales the rows
    by rstd itself (an inference forward's q: launch.LAUNCH["intra"]["Q_RSTD"])."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()  # [R, D]
    R = x2.shape[0]
    y = torch.empty_like(x2) if store_y else None
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    BR, BD = _rows_per_program(D), triton.next_power_of_2(D)
    if R:
        _l2norm_fwd_kernel[(triton.cdiv(R, BR),)](x2, y if store_y else rstd, rstd, R, float(eps), D=D, BD=BD, BR=BR,
                                                 STORE_Y=store_y)
    return (y.view(x.shape) if store_y else None), rstd


def _l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, from_y: bool) -> torch.Tensor:
    D = x.shape[-1]
    x2, dy2 = x.reshape(-1, D).contiguous(), dy.reshape(-1, D).contiguous()
    R = x2.shape[0]
    dx = torch.empty_like(x2)
    BR, BD = _rows_per_program(D), triton.next_power_of_2(D)
    if R:
        _l2norm_bwd_kernel[(triton.cdiv(R, BR),)](x2, rstd, dy2, dx, R, D=D, BD=BD, BR=BR, FROM_Y=from_y)
    return dx.view(x.shape)


def l2norm_bwd_from_y(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx [..., D] in y's dtype from the forward's output y (in x's dtype), its rstd [R] and dy (same shape as y):
    dx = r (dy - y sum_d(dy_d y_d)). With y rounded to bf16 this differs from the x-based backward by y's rounding
    (relative 2^-9) in the projection term alone."""
    return _l2norm_bwd(y, rstd, dy, True)


class _L2NormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = l2norm_fwd(x, eps)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        return _l2norm_bwd(x, rstd, dy, False), None


def l2norm_triton(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2, -1) + eps) computed in fp32, returned in x's dtype, differentiable. x: [..., D] -> [..., D].

    Same values as `l2norm(x.float()).to(x.dtype)` (gate.py) up to fp32 summation order."""
    return _L2NormTriton.apply(x, eps)
