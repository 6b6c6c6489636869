"""Fused Block AttnRes mixture (architecture.md 4) in Triton: one pass over the S sources of a sub-layer input
forward, one backward; each source's rms is computed inside that pass (it costs no extra memory traffic), fp32 math.

Per token, with q = g * w [D] and r_i = 1 / sqrt(mean_d(v_i^2) + eps):

    logit_i = (v_i . q) r_i,   alpha = softmax_i(logit),   x = sum_i alpha_i v_i
    forward: an online softmax over the sources (running max m, denominator l, fp32 accumulator), one read of each
             v_i; stores x only
    backward, from dx: a first pass over the sources recomputes m, l and x in fp32 (the same online softmax), a
             second one
             alpha_i = exp(logit_i - m) / l,   dlogit_i = alpha_i dx . (v_i - x)   (= alpha_i (dx . v_i - dx . x))
             dv_i = alpha_i dx + dlogit_i r_i q - dlogit_i (v_i . q) r_i^3 / D v_i     (the rms' own gradient last)
             dq = sum_tokens sum_i dlogit_i r_i v_i,   dg = dq * w,   dw = dq * g

The autograd graph keeps the inputs only: nothing of size [S, B, T, D], not even x. Two choices keep the gradients
as accurate as the twin's fp32 autograd: x is recomputed in fp32 from the sources rather than read back in bf16 as
FlashAttention's delta is, and dlogit takes the dot of dx with the difference v_i - x (near a one-hot softmax the
difference of the two dots dx . v_i - dx . x cancels: bf16 x, or two fp32 dots rounded differently, as a GPU
contracts them, put errors of percents into dg and dw), and the weights come from the recomputed m and l rather than a stored log-sum-exp
(whose fp32 rounding at logits ~100 is a common factor on every weight, and cancels the same way). A program's second
read of its S tiles (S * BT rows, ~55 KB at k3-small's shapes) is meant to come from L2.

The naive twin is `k3.kernels.attnres.naive.attn_res_mix`. The S source pointers reach the kernels as one tuple
argument (Triton specialises a kernel on the tuple's length and element types: one compile per source count and
dtype mix), so no stacked copy of the sources is ever made.

Legend: S sources, N tokens (B * T flattened), D width, BT tokens per tile, BD = next power of 2 >= D, P programs.
Shapes: sources [B, T, D] each (fp32 / bf16 / fp16, may differ) -> x [B, T, D] in the first source's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import check_device
from .naive import AttnResSource
from .naive import attn_res_mix as attn_res_mix_torch

# Launch settings: a tile is [BT, BD] with the whole padded width, so a token's logit is complete before its row joins
# the weighted sum; BT = max(1, elems // BD). From benchmarks/glue_tune.py on the H200 (2026-12-04, D = 768, N =
# 16,384, bf16, S = 3 / 6 / 9): fwd [2, 1024] at 2 warps 0.041 / 0.113 / 0.156 ms against [1, 1024] at 4 warps
# 0.052 / 0.121 / 0.235; bwd [1, 1024] at 2 warps, 4 tiles a program 0.121 / 0.295 / 0.455 against 4 warps, 16 tiles
# 0.148 / 0.300 / 0.641 (8 warps: 1.5 ms at S = 9; fewer warps leave more registers to the unrolled source loop)
LAUNCH = {
    "fwd": {"elems": 2048},
    # each program runs `tiles` tiles: the dq partial sums ([P, D] fp32, one torch sum after the launch)
    "bwd": {"elems": 1024, "tiles": 4},
}
ELEMS_PER_WARP = 1024  # 32 fp32 values a thread per tile: 2 warps at D = 768, more for wider rows
MAX_WIDTH = 16384  # a whole row per tile: wider rows would not fit the registers (D = 7168 at S = 9 spills already)


def num_warps_for(elems: int) -> int:
    """Warps for a tile of `elems` fp32 values: ELEMS_PER_WARP each, 2 to 16 warps."""
    return max(2, min(16, elems // ELEMS_PER_WARP))


@triton.jit
def _pseudo_query(nw_ptr, pw_ptr, cols, D):
    """q = g * w [BD] in fp32 (0 in the padded columns)."""
    col_ok = cols < D
    return (tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            * tl.load(pw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32))


@triton.jit
def _source_tile(v_ptr, offs, mask, q, inv_d, eps):
    """A source's tile v [BT, BD] in fp32 (padded rows and columns 0) and, per row, v . q, r = 1 / rms(v) and the
    logit (v . q) r. The backward calls it with the forward's arguments, so it recomputes the same logits bit for
    bit (the max source's weight is then exactly 1 / den)."""
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(v * q[None, :], 1)
    r = tl.rsqrt(tl.sum(v * v, 1) * inv_d + eps)
    return v, dot, r, dot * r


@triton.jit
def _softmax_step(m, den, logit):
    """One source of an online softmax: (new running max, the factor that rescales the old sums, this source's
    exp(logit - max), the new denominator). The factor is 0 at the first source (m = -inf)."""
    m_new = tl.maximum(m, logit)
    scale = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, scale, p, den * scale + p


@triton.jit
def _attnres_fwd_kernel(vs, nw_ptr, pw_ptr, x_ptr, N, D, eps, S: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT]
    cols = tl.arange(0, BD)  # [BD]
    mask = (rows[:, None] < N) & (cols[None, :] < D)  # [BT, BD]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    eps = tl.full([], eps, tl.float32)  # fp64 when launched by inductor (torch.compile)
    inv_d = 1.0 / tl.full([], D, tl.float32)
    q = _pseudo_query(nw_ptr, pw_ptr, cols, D)
    m = tl.full([BT], float("-inf"), tl.float32)  # running max of the logits
    den = tl.zeros([BT], tl.float32)  # running sum of exp(logit - m)
    acc = tl.zeros([BT, BD], tl.float32)  # running sum of exp(logit - m) v
    for i in tl.static_range(S):
        v, _, _, logit = _source_tile(vs[i], offs, mask, q, inv_d, eps)
        m, scale, p, den = _softmax_step(m, den, logit)
        acc = acc * scale[:, None] + p[:, None] * v
    tl.store(x_ptr + offs, (acc / den[:, None]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attnres_bwd_kernel(vs, dvs, nw_ptr, pw_ptr, dx_ptr, dq_ptr, N, D, eps, S: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)  # [BD]
    eps = tl.full([], eps, tl.float32)
    inv_d = 1.0 / tl.full([], D, tl.float32)
    q = _pseudo_query(nw_ptr, pw_ptr, cols, D)
    dq = tl.zeros([BT, BD], tl.float32)  # this program's share of dq, per row until the end
    for j in range(TILES):
        rows = (pid * TILES + j) * BT + tl.arange(0, BT)  # [BT]
        mask = (rows[:, None] < N) & (cols[None, :] < D)  # [BT, BD]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        g = tl.load(dx_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # dx
        # first pass: the softmax's max and denominator again, and x in fp32
        m = tl.full([BT], float("-inf"), tl.float32)
        den = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, BD], tl.float32)  # running sum of exp(logit - m) v
        for i in tl.static_range(S):
            v, _, _, logit = _source_tile(vs[i], offs, mask, q, inv_d, eps)
            m, scale, p, den = _softmax_step(m, den, logit)
            acc = acc * scale[:, None] + p[:, None] * v
        x = acc / den[:, None]
        for i in tl.static_range(S):  # second pass: the gradients (the program's S tiles again)
            v, dot, r, logit = _source_tile(vs[i], offs, mask, q, inv_d, eps)
            alpha = tl.exp(logit - m) / den
            # dlogit = alpha (dx . v - dx . x) as alpha dx . (v - x): near a one-hot softmax the difference of two
            # separately rounded dots cancels to noise (a GPU contracts them differently), v - x does not
            a = alpha * tl.sum(g * (v - x), 1) * r  # dlogit * r: q's coefficient in dv, v's in dq
            c = a * dot * r * r * inv_d  # dlogit (v . q) r^3 / D: v's coefficient from the rms
            dv = alpha[:, None] * g + a[:, None] * q[None, :] - c[:, None] * v
            tl.store(dvs[i] + offs, dv.to(dvs[i].dtype.element_ty), mask=mask)
            dq += a[:, None] * v
    tl.store(dq_ptr + pid * D + cols, tl.sum(dq, 0), mask=cols < D)


def _rows(v: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [N, D] row-major (a view of a contiguous tensor, else a copy)."""
    return v.reshape(-1, v.shape[-1]).contiguous()


def _tile(kind: str, d: int, n: int) -> tuple[int, int, int]:
    """(BT, BD, num_warps) of a launch of `kind` over n tokens of width d."""
    bd = triton.next_power_of_2(d)
    bt = max(1, min(LAUNCH[kind]["elems"] // bd, triton.next_power_of_2(n)))
    return bt, bd, num_warps_for(bt * bd)


def _fwd(vs: list[torch.Tensor], nw: torch.Tensor, pw: torch.Tensor, eps: float, x: torch.Tensor) -> None:
    """vs [N, D] each, nw / pw [D] -> x [N, D], written in place."""
    n, d = vs[0].shape
    bt, bd, warps = _tile("fwd", d, n)
    if n:
        _attnres_fwd_kernel[(triton.cdiv(n, bt),)](tuple(vs), nw, pw, x, n, d, eps, S=len(vs), BT=bt, BD=bd,
                                                   num_warps=warps)


def _bwd(vs: list[torch.Tensor], nw: torch.Tensor, pw: torch.Tensor, eps: float,
         dx: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vs, dx [N, D] -> (dv [N, D] per source in its dtype, dq [D] fp32)."""
    n, d = vs[0].shape
    bt, bd, warps = _tile("bwd", d, n)
    tiles = LAUNCH["bwd"]["tiles"]
    programs = triton.cdiv(n, bt * tiles)
    dvs = [torch.empty_like(v) for v in vs]
    dq_part = torch.empty(programs, d, dtype=torch.float32, device=dx.device)  # [P, D]
    if n:
        _attnres_bwd_kernel[(programs,)](tuple(vs), tuple(dvs), nw, pw, dx, dq_part, n, d, eps, S=len(vs), BT=bt,
                                         BD=bd, TILES=tiles, num_warps=warps)
    return dvs, dq_part.sum(0)


class _AttnResMix(torch.autograd.Function):
    """(g [D], w [1, D] or [D], eps, v_1 .. v_S [B, T, D]) -> x [B, T, D]; gradients for g, w and every v_i. Saves
    the inputs only."""

    @staticmethod
    def forward(ctx, norm_weight, proj_weight, eps, *vs):
        ctx.save_for_backward(norm_weight, proj_weight, *vs)
        ctx.eps = float(eps)
        if len(vs) == 1:  # weight exactly 1: x is the source (a GPU's contracted dx . v - dx . x is not exactly 0)
            return vs[0].clone()
        x = torch.empty(vs[0].shape, dtype=vs[0].dtype, device=vs[0].device)
        v2 = [_rows(v) for v in vs]
        _fwd(v2, norm_weight.contiguous(), proj_weight.reshape(-1).contiguous(), float(eps), x.view(v2[0].shape))
        return x

    @staticmethod
    def backward(ctx, dx):
        norm_weight, proj_weight, *vs = ctx.saved_tensors
        if len(vs) == 1:
            dnw = torch.zeros_like(norm_weight) if ctx.needs_input_grad[0] else None
            dpw = torch.zeros_like(proj_weight) if ctx.needs_input_grad[1] else None
            return dnw, dpw, None, dx.to(vs[0].dtype)
        nw, pw = norm_weight.contiguous(), proj_weight.reshape(-1).contiguous()
        dvs, dq = _bwd([_rows(v) for v in vs], nw, pw, ctx.eps, _rows(dx))
        dnw = (dq * pw.float()).to(norm_weight.dtype) if ctx.needs_input_grad[0] else None
        dpw = (dq * nw.float()).to(proj_weight.dtype).view(proj_weight.shape) if ctx.needs_input_grad[1] else None
        return dnw, dpw, None, *(dv.view(v.shape) for dv, v in zip(dvs, vs))


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attn_res_mix_triton(vs: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """The fused mixture of sources vs (each [B, T, D], fp32 / bf16 / fp16) with key-norm gain g [D], pseudo-query
    w [1, D] and the key norm's eps -> x [B, T, D] in vs[0]'s dtype. Differentiable in every input but eps.

    Example: x = attn_res_mix_triton([emb, block_1, partial], norm.weight, proj.weight, 1e-5)
    """
    if not vs:
        raise ValueError("attn_res_mix_triton needs at least one source")
    shape = vs[0].shape
    bad = [tuple(v.shape) for v in vs if v.shape != shape]
    if bad or len(shape) < 1:
        raise ValueError(f"attn_res_mix_triton: every source must have the first one's shape {tuple(shape)} "
                         f"[..., D]; got {bad}")
    d = shape[-1]
    if norm_weight.numel() != d or proj_weight.numel() != d:
        raise ValueError(f"attn_res_mix_triton: norm_weight {tuple(norm_weight.shape)} and proj_weight "
                         f"{tuple(proj_weight.shape)} must hold D = {d} values each")
    odd = sorted({str(t.dtype) for t in (*vs, norm_weight, proj_weight) if t.dtype not in FUSED_DTYPES})
    if odd:
        raise ValueError(f"attn_res_mix_triton takes fp32 / bf16 / fp16 tensors, got {odd}; use "
                         f"k3.kernels.attnres.naive.attn_res_mix for float64 references")
    if d > MAX_WIDTH:
        raise ValueError(f"attn_res_mix_triton holds a whole row in registers, D <= {MAX_WIDTH}; got D = {d}: use "
                         f"k3.kernels.attnres.naive.attn_res_mix")
    check_device("attn_res_mix", *vs, norm_weight, proj_weight)
    return _AttnResMix.apply(norm_weight, proj_weight, eps, *vs)


def attn_res_mix_dispatch(sources: list[AttnResSource], norm_weight: torch.Tensor,
                          proj_weight: torch.Tensor) -> torch.Tensor:
    """`attn_res_mix` on the "triton" backend: the fused kernel for fp32 / bf16 / fp16 sources; float64 (the
    references) and widths past MAX_WIDTH stay on the PyTorch twin (same formula). The sources' cached rms are not
    read: the kernel computes them in its pass."""
    tensors = (*(s.v for s in sources), norm_weight, proj_weight)
    if any(t.dtype not in FUSED_DTYPES for t in tensors) or sources[0].v.shape[-1] > MAX_WIDTH:
        return attn_res_mix_torch(sources, norm_weight, proj_weight)
    eps = {s.eps for s in sources}
    if len(eps) != 1:
        raise ValueError(f"attn_res_mix: the sources of one mixture share their key norm's eps, got {sorted(eps)}")
    return attn_res_mix_triton([s.v for s in sources], norm_weight, proj_weight, eps.pop())
