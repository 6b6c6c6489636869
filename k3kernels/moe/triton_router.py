"""Fused sigmoid top-K router and Quantile Balancing margin histogram in Triton (architecture.md 9.1, 9.2).

Router (DeepSeek-V3 section 2.1.2 form, as k3.model.moe.Router):

    s_ij   = sigmoid(logit_ij)                                  fp32
    sel_i  = top-K of s_ij + b_j over j, ties -> lowest j       (bias changes the selection only)
    w_ik   = s_{i,sel_ik} / sum_k' s_{i,sel_ik'} * rsf          (weights from the unbiased scores)

One program handles BLOCK_N tokens x all E experts (E padded to a power of two): K rounds of "row max, lowest index
holding it, knock it out". Equal biased scores are taken in index order, exactly what the Router's stable
descending sort does.

QB histogram (Su Jianlin, kexue.fm/archives/11619; K3 report App. D), as k3.train.balance.qb_histogram_counts:

    alpha_i   = (k+1)-th largest of s_ij + b_j                  (k+1 rounds of the same max / knock-out)
    margin_ij = s_ij - alpha_i
    bin_ij    = clamp(floor((margin_ij - lo) * (nb / (hi - lo))), 0, nb - 1)      (fp32, as torch computes it)
    counts[j, bin_ij] += 1                                      (atomic adds, int32, returned as int64)

Legend: N tokens, E experts, K experts per token, nb histogram bins, rsf routed_scaling_factor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 8


@triton.jit
def _sigmoid(x):
    """sigmoid from exp(-|x|), which never overflows."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _router_topk_kernel(logit_ptr, bias_ptr, score_ptr, idx_ptr, w_ptr, N, E, stride_l, rsf, FROM_SCORES: tl.constexpr,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    kcols = tl.arange(0, KP)  # [KP]
    rmask = rows < N
    mask = rmask[:, None] & (cols[None, :] < E)  # [BN, BE]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(logit_ptr + r64 * stride_l + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if FROM_SCORES:  # the input already holds the sigmoid scores (computed by torch: bitwise the Router's)
        s = x
    else:
        s = _sigmoid(x)  # [BN, BE]
        tl.store(score_ptr + r64 * E + cols[None, :], s, mask=mask)
    b = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)  # [BE]
    biased = tl.where(mask, s + b[None, :], float("-inf"))
    idx_t = tl.zeros((BLOCK_N, KP), dtype=tl.int64)
    sel_t = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
    for i in tl.static_range(K):
        mx = tl.max(biased, axis=1)  # [BN]
        j = tl.min(tl.where(biased == mx[:, None], cols[None, :], BLOCK_E), axis=1)  # [BN] lowest index at the max
        hit = cols[None, :] == j[:, None]  # [BN, BE]
        sel = tl.sum(tl.where(hit, s, 0.0), axis=1)  # [BN] unbiased score of the pick
        biased = tl.where(hit, float("-inf"), biased)
        idx_t = tl.where(kcols[None, :] == i, j[:, None].to(tl.int64), idx_t)
        sel_t = tl.where(kcols[None, :] == i, sel[:, None], sel_t)
    total = tl.sum(sel_t, axis=1)  # [BN] (unused slots hold 0)
    total = tl.where(rmask, total, 1.0)  # rows past N (all-zero scores when FROM_SCORES): no 0 / 0
    w = sel_t / total[:, None] * rsf
    kmask = rmask[:, None] & (kcols[None, :] < K)
    tl.store(idx_ptr + r64 * K + kcols[None, :], idx_t, mask=kmask)
    tl.store(w_ptr + r64 * K + kcols[None, :], w, mask=kmask)


@triton.jit
def _qb_histogram_kernel(score_ptr, bias_ptr, range_ptr, counts_ptr, N, E, stride_s, n_bins,
                         KP1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    mask = (rows[:, None] < N) & (cols[None, :] < E)  # [BN, BE]
    r64 = rows.to(tl.int64)[:, None]
    s = tl.load(score_ptr + r64 * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)  # [BE]
    biased = tl.where(mask, s + b[None, :], float("-inf"))
    for _ in tl.static_range(KP1 - 1):  # knock out the k largest, one instance each (duplicates count separately)
        mx = tl.max(biased, axis=1)
        j = tl.min(tl.where(biased == mx[:, None], cols[None, :], BLOCK_E), axis=1)
        biased = tl.where(cols[None, :] == j[:, None], float("-inf"), biased)
    alpha = tl.max(biased, axis=1)  # [BN] (k+1)-th largest biased score
    lo = tl.load(range_ptr)  # fp32, exactly the value torch uses for the Python float
    scale = tl.load(range_ptr + 1)  # fp32(nb / (hi - lo))
    x = ((s - alpha[:, None]) - lo) * scale
    binf = tl.minimum(tl.maximum(tl.floor(x), 0.0), n_bins - 1.0)  # clamp into the end bins
    flat = cols[None, :] * n_bins + binf.to(tl.int32)  # expert j owns bins [j nb, (j+1) nb)
    tl.atomic_add(counts_ptr + flat, tl.full((BLOCK_N, BLOCK_E), 1, tl.int32), mask=mask)


def _num_warps(e: int) -> int:
    """More warps for wide tiles (K3: E = 896 -> a [8, 1024] tile), so each thread holds <= 32 values per tensor."""
    return 8 if BLOCK_N * triton.next_power_of_2(e) >= 8192 else 4


def _check(x: torch.Tensor, bias: torch.Tensor, k: int, name: str, k_max: int) -> None:
    if x.dim() != 2 or bias.dim() != 1 or x.shape[1] != bias.shape[0]:
        raise ValueError(f"{name} expects [N, E] and bias [E]; got {tuple(x.shape)} and {tuple(bias.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} takes fp32 inputs (got {x.dtype}); cast with .float(), or use the torch path for "
                         "float64 references")
    if x.device != bias.device:
        raise ValueError(f"{name}: inputs on {x.device} but bias on {bias.device}; move the bias")
    if not 0 < k <= k_max:
        raise ValueError(f"{name}: k = {k} must lie in [1, {k_max}] for E = {x.shape[1]}")


def _launch_topk(x: torch.Tensor, bias: torch.Tensor, k: int, rsf: float, from_scores: bool):
    """Run the selection kernel. x [N, E] logits (or scores when from_scores) -> (scores, idx [N, k], w [N, k])."""
    n, e = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    scores = x if from_scores else torch.empty((n, e), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, k), dtype=torch.int64, device=x.device)
    w = torch.empty((n, k), dtype=torch.float32, device=x.device)
    if n:
        _router_topk_kernel[(triton.cdiv(n, BLOCK_N),)](
            x, bias.float().contiguous(), scores, idx, w, n, e, x.stride(0), float(rsf), FROM_SCORES=from_scores,
            K=k, KP=triton.next_power_of_2(k), BLOCK_N=BLOCK_N, BLOCK_E=triton.next_power_of_2(e),
            num_warps=_num_warps(e))
    return scores, idx, w


def _d_scores(scores, idx, d_scores, d_w, rsf):
    """Gradient w.r.t. the scores: d_scores plus the renormalised weights' part.

    w_k = rsf s_k / S, S = sum_k s_k  =>  d s_k = rsf / S (d w_k - sum_k' d w_k' s_k' / S); [N, K] elementwise and
    one scatter, cheap next to the forward's selection.
    """
    ds = torch.zeros_like(scores) if d_scores is None else d_scores.float().clone()
    if d_w is not None:
        sel = scores.gather(1, idx)  # [N, K]
        tot = sel.sum(-1, keepdim=True)
        ds.scatter_add_(1, idx, rsf / tot * (d_w - (d_w * sel).sum(-1, keepdim=True) / tot))
    return ds


class _RouterTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, k, rsf):
        scores, idx, w = _launch_topk(logits, bias, k, rsf, from_scores=False)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(scores, idx)
        ctx.rsf = float(rsf)
        return scores, idx, w

    @staticmethod
    def backward(ctx, d_scores, _d_idx, d_w):
        scores, idx = ctx.saved_tensors
        ds = _d_scores(scores, idx, d_scores, d_w, ctx.rsf)
        return ds * scores * (1.0 - scores), None, None, None  # through the sigmoid


class _RouterSelect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, bias, k, rsf):
        _, idx, w = _launch_topk(scores, bias, k, rsf, from_scores=True)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(scores, idx)
        ctx.rsf = float(rsf)
        return idx, w

    @staticmethod
    def backward(ctx, _d_idx, d_w):
        scores, idx = ctx.saved_tensors
        return _d_scores(scores, idx, None, d_w, ctx.rsf), None, None, None


def router_topk_triton(logits: torch.Tensor, bias: torch.Tensor, k: int, routed_scaling_factor: float = 1.0):
    """Fused sigmoid top-K routing (k3.model.moe.Router after its linear).

    Args: logits [N, E] fp32 (x @ W_router^T); bias [E] the selection-only e_score_correction_bias; k experts per
    token (1 <= k <= E); routed_scaling_factor rsf.
    Returns: scores [N, E] fp32 sigmoid; topk_idx [N, k] int64 in biased-score order (ties -> lowest index);
    topk_weight [N, k] fp32 = selected scores / their sum * rsf. scores and weights are differentiable w.r.t.
    logits (torch backward); the bias gets no gradient. The sigmoid runs in the kernel and may differ from
    torch.sigmoid in the last bit, which can flip a near-tie against the torch Router; router_select_triton on
    torch.sigmoid scores is the bitwise twin.

    Example: s, idx, w = router_topk_triton(F.linear(x.float(), w_router.float()), bias, 8)
    """
    _check(logits, bias, k, "router_topk_triton", logits.shape[1] if logits.dim() == 2 else 0)
    return _RouterTopK.apply(logits, bias.detach(), k, routed_scaling_factor)


def router_select_triton(scores: torch.Tensor, bias: torch.Tensor, k: int, routed_scaling_factor: float = 1.0):
    """Fused top-K selection and weights from precomputed scores: bitwise the Router's selection for the same scores.

    Args: scores [N, E] fp32 sigmoid scores (torch.sigmoid(logits), as Router computes them); bias [E]; k; rsf.
    Returns: topk_idx [N, k] int64 (biased-score order, ties -> lowest index); topk_weight [N, k] fp32,
    differentiable w.r.t. scores (torch backward).

    Use this rather than router_topk_triton where the selection must equal the torch Router's exactly: the in-kernel
    sigmoid of router_topk_triton may differ from torch.sigmoid in the last bit, which can flip a near-tie.
    Example: s = torch.sigmoid(logits); idx, w = router_select_triton(s, bias, 8)
    """
    _check(scores, bias, k, "router_select_triton", scores.shape[1] if scores.dim() == 2 else 0)
    return _RouterSelect.apply(scores, bias.detach(), k, routed_scaling_factor)


def qb_histogram_triton(scores: torch.Tensor, bias: torch.Tensor, k: int, n_bins: int, lo: float,
                        hi: float) -> torch.Tensor:
    """Per-expert histogram of QB margins, equal to k3.train.balance.qb_histogram_counts bin for bin.

    Args: scores [N, E] fp32 unbiased router scores (drop padding tokens first); bias [E]; k (1 <= k < E: the
    (k+1)-th biased score is the cutoff); n_bins nb; lo < hi the binned range (the caller supplies it, e.g.
    k3.train.balance.qb_default_range(bias), the same on every micro-batch and rank). Margins outside [lo, hi) land
    in the end bins.
    Returns: counts [E, nb] int64, additive over micro-batches and ranks.

    Example: counts = qb_histogram_triton(s, b, 4, 512, *qb_default_range(b))
    """
    _check(scores, bias, k, "qb_histogram_triton", scores.shape[1] - 1 if scores.dim() == 2 else 0)
    if n_bins < 1:
        raise ValueError(f"qb_histogram_triton: n_bins must be >= 1, got {n_bins}")
    if not hi > lo:
        raise ValueError(f"qb_histogram_triton: histogram range needs hi > lo, got [{lo}, {hi}]")
    if scores.shape[0] == 0:
        raise ValueError("qb_histogram_triton got an empty batch (N = 0); skip the update for this step instead")
    n, e = scores.shape
    if e * n_bins >= 2**31 or n >= 2**31:
        raise ValueError(f"qb_histogram_triton: E * n_bins = {e * n_bins} and N = {n} must stay below 2^31")
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    # the range as torch uses it for `(margin - lo) * (n_bins / (hi - lo))` on an fp32 tensor: both scalars in fp32
    rng = torch.tensor([lo, n_bins / (hi - lo)], dtype=torch.float32, device=scores.device)
    counts = torch.zeros(e * n_bins, dtype=torch.int32, device=scores.device)
    _qb_histogram_kernel[(triton.cdiv(n, BLOCK_N),)](
        scores, bias.detach().float().contiguous(), rng, counts, n, e, scores.stride(0), n_bins, KP1=k + 1,
        BLOCK_N=BLOCK_N, BLOCK_E=triton.next_power_of_2(e), num_warps=_num_warps(e))
    return counts.view(e, n_bins).long()
