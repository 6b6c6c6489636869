"""Causal depthwise short convolution + SiLU in Triton, forward and backward, up to three inputs in one launch.

Legend: B batch, T tokens, C channels, W kernel width, n inputs (1 to 3: a KDA layer's q, k and v), BT rows and
BC channels per program, s(.) the sigmoid.

    pre[t, c] = sum_{j=0}^{W-1} weight[c, W-1-j] x[t-j, c]          (taps before the sequence's first row are 0)
    y = SiLU(pre) = pre s(pre)         dpre = dy s(pre) (1 + pre (1 - s(pre)))       (dpre = dy without SiLU)
    dx[t, c] = sum_j weight[c, W-1-j] dpre[t+j, c]                 (rows t+j of the same sequence only)
    dweight[c, W-1-j] = sum_t dpre[t, c] x[t-j, c]

Each input keeps its own tensors (the three projections' outputs, no cat): program axis 2 picks the input. The
backward recomputes pre from the saved inputs (nothing else is kept) and writes fp32 dweight partial sums per row
block, summed once afterwards (deterministic, no atomics). fp32 math inside, outputs in the input dtype. Packed
sequences (cu_seqlens, B == 1) pass each row's sequence start, so a tap never crosses a boundary. The carried tail
of inference (initial_tail / output_final_tail) stays on the PyTorch twin, `k3.kernels.conv.naive.causal_conv1d`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import ACTIVATIONS, check_group
from .naive import causal_conv1d as causal_conv1d_torch
from .naive import causal_conv1d_multi as causal_conv1d_multi_torch

# launch table (one comment per knob; ptxas registers for sm_90a at W = 4, bf16, no spills; not yet timed on a GPU)
LAUNCH = {
    # forward: W row-shifted loads of a [BT, BC] tile (rows past the first shift hit in L1 / L2); 128 bf16 channels
    # are 256 contiguous bytes per row; 8 warps keep it at 98 registers (4 warps: 252, the W tiles loaded at once)
    "fwd": {"BT": 64, "BC": 128, "num_warps": 8},
    # backward: W * W shifted x loads and W dy loads per tile with dx and dpre live: 32 x 64 tiles over 4 warps take
    # 144 registers (64 x 64: 255 and spills); one fp32 [BC, W] dweight partial per 32-row block (4.7 MB per input
    # at B = 4, T = 4096, C = 768, a few microseconds to sum)
    "bwd": {"BT": 32, "BC": 64, "num_warps": 4},
}
MAX_INPUTS = 3


@triton.jit
def _pick(i, a, b, c):
    """The i-th (0, 1, 2) of three pointers: one launch serves up to three inputs on program axis 2."""
    if i == 0:
        p = a
    elif i == 1:
        p = b
    else:
        p = c
    return p


@triton.jit
def _row_start(seq_start, t, T, VARLEN: tl.constexpr):
    """[BT] first row of each row's sequence: seq_start[t] when packed, else 0 (rows of one batch row)."""
    if VARLEN:
        s = tl.load(seq_start + t, mask=t < T, other=0)
    else:
        s = tl.zeros(t.shape, tl.int32)
    return s


@triton.jit
def _tap(x_ptr, base, r, lo, T, C, c, c_ok):
    """x[r, c] as fp32 [BT, BC] where lo <= r < T (0 elsewhere)."""
    m = ((r >= lo) & (r < T))[:, None] & c_ok[None, :]
    return tl.load(x_ptr + base + r.to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _conv_fwd_kernel(x0, x1, x2, w0, w1, w2, y0, y1, y2, seq_start, T, C, W: tl.constexpr, SILU: tl.constexpr,
                     VARLEN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_t = tl.cdiv(T, BT)
    b, tb = pid_t // n_t, pid_t % n_t
    x_ptr, w_ptr, y_ptr = _pick(i, x0, x1, x2), _pick(i, w0, w1, w2), _pick(i, y0, y1, y2)
    t = tb * BT + tl.arange(0, BT)  # [BT] rows of batch row b
    c = pid_c * BC + tl.arange(0, BC)  # [BC]
    c_ok = c < C
    base = b.to(tl.int64) * T * C
    start = _row_start(seq_start, t, T, VARLEN)
    acc = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):  # j rows back: weight column W-1-j
        w_j = tl.load(w_ptr + c * W + (W - 1 - j), mask=c_ok, other=0.0).to(tl.float32)
        acc += _tap(x_ptr, base, t - j, start, T, C, c, c_ok) * w_j[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    m = (t < T)[:, None] & c_ok[None, :]
    tl.store(y_ptr + base + t.to(tl.int64)[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_bwd_kernel(x0, x1, x2, w0, w1, w2, dy0, dy1, dy2, dx0, dx1, dx2, dw_part, seq_start, T, C,
                     W: tl.constexpr, SILU: tl.constexpr, VARLEN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_t = tl.cdiv(T, BT)
    b, tb = pid_t // n_t, pid_t % n_t
    x_ptr, w_ptr = _pick(i, x0, x1, x2), _pick(i, w0, w1, w2)
    dy_ptr, dx_ptr = _pick(i, dy0, dy1, dy2), _pick(i, dx0, dx1, dx2)
    t = tb * BT + tl.arange(0, BT)  # [BT]
    c = pid_c * BC + tl.arange(0, BC)  # [BC]
    c_ok = c < C
    base = b.to(tl.int64) * T * C
    start = _row_start(seq_start, t, T, VARLEN)
    dx = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):  # dpre at row p = t + j reaches dx[t] through weight column W-1-j
        p = t + j
        p_start = _row_start(seq_start, p, T, VARLEN)
        p_ok = (p < T) & (p_start == start)  # [BT] row p exists and lies in row t's sequence
        m = p_ok[:, None] & c_ok[None, :]
        dpre = tl.load(dy_ptr + base + p.to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        if SILU:  # pre at row p, recomputed from its W taps
            pre = tl.zeros([BT, BC], tl.float32)
            for j2 in tl.static_range(W):
                w_j2 = tl.load(w_ptr + c * W + (W - 1 - j2), mask=c_ok, other=0.0).to(tl.float32)
                pre += _tap(x_ptr, base, p - j2, p_start, T, C, c, c_ok) * w_j2[None, :]
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        w_j = tl.load(w_ptr + c * W + (W - 1 - j), mask=c_ok, other=0.0).to(tl.float32)
        dx += dpre * w_j[None, :]
        if j == 0:  # this block's rows' share of dweight: sum_t dpre[t] x[t - j2] per column W-1-j2
            part = dw_part + ((i * tl.num_programs(0) + pid_t).to(tl.int64) * C + c) * W
            for j2 in tl.static_range(W):
                x_j2 = _tap(x_ptr, base, t - j2, start, T, C, c, c_ok)
                tl.store(part + (W - 1 - j2), tl.sum(dpre * x_j2, axis=0), mask=c_ok)
    m = (t < T)[:, None] & c_ok[None, :]
    tl.store(dx_ptr + base + t.to(tl.int64)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)


def _seq_start(cu_seqlens: torch.Tensor | None, T: int, device) -> torch.Tensor | None:
    """[T] int32: the first row of each packed row's sequence (None without cu_seqlens). output_size: the lengths
    sum to T (checked by the caller), and without it the size would be read back from the device."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    return torch.repeat_interleave(cu[:-1], cu.diff(), output_size=T).to(torch.int32)


def _three(ts):
    """Pad a list of 1-3 tensors to three kernel arguments (the unused ones are never touched)."""
    return [*ts, *[ts[0]] * (MAX_INPUTS - len(ts))]


def _or_placeholder(seq_start, x):
    """The kernels take seq_start as an argument and ignore it under VARLEN=False: any tensor serves then."""
    return x if seq_start is None else seq_start


def _grid(kind: str, B: int, T: int, C: int, n: int):
    cfg = LAUNCH[kind]
    return (B * triton.cdiv(T, cfg["BT"]), triton.cdiv(C, cfg["BC"]), n)


def conv_fwd(xs, ws, seq_start, silu: bool):
    """xs n x [B, T, C] (contiguous), ws n x [C, W] (contiguous) -> n x y [B, T, C] in x's dtype."""
    B, T, C = xs[0].shape
    ys = [torch.empty_like(x) for x in xs]
    if xs[0].numel():
        cfg = LAUNCH["fwd"]
        _conv_fwd_kernel[_grid("fwd", B, T, C, len(xs))](
            *_three(xs), *_three(ws), *_three(ys), _or_placeholder(seq_start, xs[0]), T, C, W=ws[0].shape[1],
            SILU=silu, VARLEN=seq_start is not None, BT=cfg["BT"], BC=cfg["BC"], num_warps=cfg["num_warps"])
    return ys


def conv_bwd(xs, ws, dys, seq_start, silu: bool):
    """-> (n x dx [B, T, C] in x's dtype, n x dweight [C, W] in the weight's dtype)."""
    B, T, C = xs[0].shape
    W, n = ws[0].shape[1], len(xs)
    dxs = [torch.empty_like(x) for x in xs]
    grid = _grid("bwd", B, T, C, n)
    parts = torch.empty(n, grid[0], C, W, dtype=torch.float32, device=xs[0].device)  # [n, row blocks, C, W]
    if xs[0].numel():
        cfg = LAUNCH["bwd"]
        _conv_bwd_kernel[grid](*_three(xs), *_three(ws), *_three(dys), *_three(dxs), parts,
                               _or_placeholder(seq_start, xs[0]), T, C, W=W, SILU=silu,
                               VARLEN=seq_start is not None, BT=cfg["BT"], BC=cfg["BC"], num_warps=cfg["num_warps"])
    dw = parts.sum(1)  # [n, C, W]
    return dxs, [dw[k].to(w.dtype) for k, w in enumerate(ws)]


class _CausalConv1d(torch.autograd.Function):
    """(silu, seq_start, x_1..x_n, w_1..w_n) -> (y_1..y_n); saves only the inputs and weights."""

    @staticmethod
    def forward(ctx, silu, seq_start, *xw):
        n = len(xw) // 2
        xs, ws = [x.contiguous() for x in xw[:n]], [w.contiguous() for w in xw[n:]]
        ctx.silu, ctx.n = silu, n
        ctx.save_for_backward(seq_start, *xs, *ws)
        return tuple(conv_fwd(xs, ws, seq_start, silu))

    @staticmethod
    def backward(ctx, *dys):
        seq_start, *xw = ctx.saved_tensors
        n = ctx.n
        dxs, dws = conv_bwd(xw[:n], xw[n:], [dy.contiguous() for dy in dys], seq_start, ctx.silu)
        return None, None, *dxs, *dws


def causal_conv1d_multi_triton(xs, weights, *, activation: str | None = "silu", cu_seqlens=None):
    """`causal_conv1d_multi` in one Triton launch each way. xs: 1-3 tensors [B, T, C] of one shape and dtype
    (fp32 / bf16 / fp16), weights: as many [C, W]; cu_seqlens [N+1] with B == 1. Returns the tuple of y [B, T, C].

    Example: q, k, v = causal_conv1d_multi_triton([q_pre, k_pre, v_pre], [wq, wk, wv])
    """
    xs, weights = list(xs), list(weights)
    check_group(xs, weights, activation, cu_seqlens, max_inputs=MAX_INPUTS)
    if xs[0].dtype == torch.float64:
        return causal_conv1d_multi_torch(xs, weights, activation=activation, cu_seqlens=cu_seqlens)
    check_device("causal_conv1d", *xs, *weights)
    seq_start = _seq_start(cu_seqlens, xs[0].shape[1], xs[0].device)
    return _CausalConv1d.apply(activation == "silu", seq_start, *xs, *weights)


def causal_conv1d_triton(x, weight, *, activation: str | None = "silu", initial_tail=None,
                         output_final_tail: bool = False, cu_seqlens=None):
    """`causal_conv1d` on the "triton" backend: the fused kernel without a carried tail (training); a tail in or
    out, and float64, run the PyTorch twin (same signature, same results up to fp32 rounding)."""
    if initial_tail is not None or output_final_tail or x.dtype == torch.float64 or activation not in ACTIVATIONS:
        return causal_conv1d_torch(x, weight, activation=activation, initial_tail=initial_tail,
                                   output_final_tail=output_final_tail, cu_seqlens=cu_seqlens)
    (y,) = causal_conv1d_multi_triton([x], [weight], activation=activation, cu_seqlens=cu_seqlens)
    return y, None
