"""The MoE combine (moe_unpermute) in Triton for training: each token's K expert outputs gathered and weighted in one
pass, and the backward in one pass too. The PyTorch twin is `k3.kernels.moe.naive.moe_unpermute` (a gather through
the inverse permutation, a product, a sum over K, and their three backwards over [M, O]).

Legend: N tokens, K slots per token, M = N K routed rows in expert order, O width; row_NK[n, k] = the row of y
holding token n's k-th expert output (the inverse of moe_permute's order).

    out[n]      = sum_k w[n, k] y[row_NK[n, k]]                       (fp32 sum, rounded once to y's dtype)
    dy[row]     = w[n, k] dout[n]       for (n, k) owning that row     (every row written once: a permutation)
    dw[n, k]    = dout[n] . y[row_NK[n, k]]                            (fp32 dot)

One program per token, the whole row of O in registers; no atomics, deterministic. The twin rounds each product
w y to y's dtype before its fp32 sum; here the products stay fp32 (the tests compare both to float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import _inverse_permutation, moe_unpermute

NUM_WARPS = 2
MAX_WIDTH = 8192  # a whole row per program


@triton.jit
def _combine_fwd_kernel(y, rows, w, out, O: tl.constexpr, K: tl.constexpr, BO: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BO)
    cm = cols < O
    acc = tl.zeros([BO], dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(rows + n * K + k).to(tl.int64)
        wk = tl.load(w + n * K + k).to(tl.float32)
        acc += wk * tl.load(y + r * O + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out + n * O + cols, acc.to(out.dtype.element_ty), mask=cm)


@triton.jit
def _combine_bwd_kernel(y, rows, w, dout, dy, dw, O: tl.constexpr, K: tl.constexpr, BO: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BO)
    cm = cols < O
    g = tl.load(dout + n * O + cols, mask=cm, other=0.0).to(tl.float32)
    for k in tl.static_range(K):
        r = tl.load(rows + n * K + k).to(tl.int64)
        wk = tl.load(w + n * K + k).to(tl.float32)
        yv = tl.load(y + r * O + cols, mask=cm, other=0.0).to(tl.float32)
        tl.store(dw + n * K + k, tl.sum(g * yv, axis=0))
        tl.store(dy + r * O + cols, (wk * g).to(dy.dtype.element_ty), mask=cm)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MO, rows_NK, w_NK):
        N, K = w_NK.shape
        O = y_MO.shape[1]
        out = torch.empty(N, O, dtype=y_MO.dtype, device=y_MO.device)
        if out.numel():
            _combine_fwd_kernel[(N,)](y_MO, rows_NK, w_NK, out, O=O, K=K, BO=triton.next_power_of_2(O),
                                      num_warps=NUM_WARPS)
        ctx.save_for_backward(y_MO, rows_NK, w_NK)
        return out

    @staticmethod
    def backward(ctx, dout):
        y_MO, rows_NK, w_NK = ctx.saved_tensors
        N, K = w_NK.shape
        O = y_MO.shape[1]
        dy = torch.empty_like(y_MO)
        dw = torch.empty(N, K, dtype=torch.float32, device=w_NK.device)
        if dy.numel():
            _combine_bwd_kernel[(N,)](y_MO, rows_NK, w_NK, dout.contiguous(), dy, dw, O=O, K=K,
                                      BO=triton.next_power_of_2(O), num_warps=NUM_WARPS)
        return dy, None, dw.to(w_NK.dtype)


def moe_unpermute_triton(y_MO: torch.Tensor, order_M: torch.Tensor, topk_weight_NK: torch.Tensor) -> torch.Tensor:
    """`moe_unpermute` on the "triton" backend, for training: the fused combine when autograd records y or the
    weights (fp32 / bf16 / fp16, O <= MAX_WIDTH); the twin under no_grad (inference and the compiled decode keep
    their aten ops), for float64 and inside torch.compile. Same contract as the twin: out [N, O] in y's dtype."""
    N, K = topk_weight_NK.shape
    M = order_M.numel()
    if y_MO.shape[0] != M or M != N * K:
        raise ValueError(f"moe_unpermute: y has {y_MO.shape[0]} rows, order has {M}, weights give N*K = {N * K}")
    grad = torch.is_grad_enabled() and (y_MO.requires_grad or topk_weight_NK.requires_grad)
    if (not grad or torch.float64 in (y_MO.dtype, topk_weight_NK.dtype) or y_MO.dim() != 2
            or y_MO.shape[1] > MAX_WIDTH or torch.compiler.is_compiling()):
        return moe_unpermute(y_MO, order_M, topk_weight_NK)
    check_device("moe_unpermute", y_MO, topk_weight_NK)
    rows_NK = _inverse_permutation(order_M).view(N, K)
    return _Combine.apply(y_MO.contiguous(), rows_NK, topk_weight_NK.contiguous())
