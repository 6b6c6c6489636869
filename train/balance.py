"""Routing balance: Quantile Balancing (exact and histogram), Loss-Free Balancing, load statistics.

Pure tensor functions in fp32 (float64 inputs stay float64); no optimizer or model knowledge. The trainer routes a
batch with the current bias b (the router's `e_score_correction_bias`), then calls one of the updates on the
recorded unbiased scores and replaces b with the result after the optimizer step (architecture.md 9.2: routing the
batch with the new b would leak information). Drop padding tokens from `scores` before calling.

Quantile Balancing (QB; Su Jianlin, kexue.fm/archives/11619; K3 report section 2.3.3, Eq. 13-14, App. D, reported):
the balanced assignment "each token takes k experts, each expert takes q = m k / n tokens" is an LP whose dual is
solved by alternating order statistics. One step:

    alpha_i     = (k+1)-th largest of s_i + b                  (token i's cutoff under the current bias)
    margin_ij   = s_ij - alpha_i
    b_hat_j     = -((q+1)-th largest of margin_:j)             (then count_j(s + b_hat_j > alpha) <= q)
    b_new       = b_hat - mean(b_hat)                          (a common shift changes no top-k)

Legend: m tokens, n experts, k experts per token, q target tokens per expert, nb histogram bins.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], "torch.Tensor | None"]


def _fdtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check(scores: torch.Tensor, bias: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or bias.dim() != 1 or scores.shape[1] != bias.shape[0]:
        raise ValueError(f"QB expects scores [m, n] and bias [n]; got {tuple(scores.shape)} and {tuple(bias.shape)}")
    if not 0 < k < scores.shape[1]:
        raise ValueError(f"QB needs 0 < k < n (it reads the (k+1)-th score); got k = {k}, n = {scores.shape[1]}")
    if scores.shape[0] == 0:
        raise ValueError("QB got an empty batch (m = 0); skip the update for this step instead")


def qb_target(m: int, k: int, n: int) -> int:
    """Tokens per expert at perfect balance, q = round(m k / n) (halves round up, not to even).

    Example: qb_target(8, 1, 4) == 2
    """
    return math.floor(m * k / n + 0.5)


def qb_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """QB margins under the current bias.

    Args: scores [m, n] unbiased router scores; bias [n]; k experts per token.
    Returns: (margin [m, n] = s - alpha, alpha [m] = (k+1)-th largest biased score per token), fp32 or float64.

    Example: margin, alpha = qb_margins(s, b, 4)   # token i routes to j iff margin_ij > -b_j (no ties)
    """
    _check(scores, bias, k)
    s = scores.to(_fdtype(scores))
    alpha = torch.topk(s + bias.to(s.dtype), k + 1, dim=1).values[:, k]
    return s - alpha[:, None], alpha


def _kth_largest_rank(q: int, m: int) -> int:
    # The (q+1)-th largest needs q + 1 <= m. With q >= m every token would have to take the expert, which no finite
    # cutoff from the margins expresses exactly; the smallest margin (rank m) is the closest finite choice and caps
    # the count at m - 1. q < 0 is a caller error.
    if q < 0:
        raise ValueError(f"QB target q must be >= 0, got {q}")
    return min(q + 1, m)


def qb_update_exact(scores: torch.Tensor, bias: torch.Tensor, k: int, q: int | None = None,
                    center: bool = True) -> torch.Tensor:
    """One exact (sort-based) Quantile Balancing step, for a batch held whole on one device.

    Args: scores [m, n] unbiased sigmoid scores of the tokens routed with `bias`; bias [n] current bias; k experts per
    token; q target per expert (default `qb_target(m, k, n)`); center subtracts the mean (False returns b_hat).
    Returns: new bias [n] in bias's dtype; it replaces the old one (no step size, no EMA).

    Example (architecture.md 9.2 test vector, m=8, n=4, k=1): loads (4,3,1,0) -> b ~= (-0.22,-0.13,0.22,0.13).
    """
    margin, _ = qb_margins(scores, bias, k)
    m, n = margin.shape
    q = qb_target(m, k, n) if q is None else q
    r = _kth_largest_rank(q, m)
    # (r)-th largest = (m - r + 1)-th smallest
    b_hat = -torch.kthvalue(margin, m - r + 1, dim=0).values
    if center:
        b_hat = b_hat - b_hat.mean()
    return b_hat.to(bias.dtype)


def qb_default_range(bias: torch.Tensor) -> tuple[float, float]:
    """Histogram range [-1 - db, 1 + db], db = max b - min b (k3 choice, architecture.md 9.2).

    With s in (0, 1) and a mean-centred b, margins lie in (-1 - max b, 1 - min b), inside this range; anything
    outside is clamped into the end bins. Every rank derives the same range from the same (replicated) bias, so the
    counts stay additive. Example: qb_default_range(torch.zeros(4)) == (-1.0, 1.0)
    """
    db = float(bias.max() - bias.min())
    return -1.0 - db, 1.0 + db


def qb_histogram_counts(scores: torch.Tensor, bias: torch.Tensor, k: int, n_bins: int = 512,
                        lo: float | None = None, hi: float | None = None) -> torch.Tensor:
    """Per-expert histogram of QB margins, additive over micro-batches and ranks.

    Args: scores [m, n]; bias [n]; k; n_bins nb; lo, hi the binned range (default `qb_default_range(bias)`; use the
    same values for every micro-batch and rank). Values outside [lo, hi) go to the end bins.
    Returns: counts [n, nb] int64 (sum them, then `qb_update_histogram`).

    Example: counts = qb_histogram_counts(s1, b, 4) + qb_histogram_counts(s2, b, 4)
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if lo is None or hi is None:
        dlo, dhi = qb_default_range(bias)
        lo, hi = (dlo if lo is None else lo), (dhi if hi is None else hi)
    if not hi > lo:
        raise ValueError(f"histogram range needs hi > lo, got [{lo}, {hi}]")
    margin, _ = qb_margins(scores, bias, k)
    n = margin.shape[1]
    bins = torch.floor((margin - lo) * (n_bins / (hi - lo))).long().clamp_(0, n_bins - 1)  # [m, n]
    flat = bins + torch.arange(n, device=bins.device) * n_bins  # expert j owns bins [j*nb, (j+1)*nb)
    return torch.bincount(flat.reshape(-1), minlength=n * n_bins).view(n, n_bins)


def qb_update_histogram(counts: torch.Tensor, lo: float, hi: float, q: int | None = None, *, k: int | None = None,
                        all_reduce: AllReduce | None = None, center: bool = True) -> torch.Tensor:
    """QB step from margin histograms: b_hat_j = -(q+1)-th largest margin, interpolated inside the crossing bin.

    Args: counts [n, nb] from `qb_histogram_counts` (summed over micro-batches); lo, hi the range they were binned
    with; q the target (or pass k and q = round(m k / n) with m = the counted tokens); all_reduce an optional hook
    applied to counts first (e.g. `lambda c: dist.all_reduce(c)`; in place when it returns None, else its result is
    used); center subtracts the mean.
    Returns: new bias [n] fp32.

    Inside the crossing bin the c counts are taken as evenly spread: the r-th largest of them sits at the middle of
    the r-th of c equal slots from the top. Snapping to bin edges instead locks the iteration (reported from a
    torchtitan port: CV stuck at 0.23).

    Example: b = qb_update_histogram(counts, lo, hi, k=4)
    """
    if counts.dim() != 2:
        raise ValueError(f"counts must be [n, n_bins], got {tuple(counts.shape)}")
    if all_reduce is not None:
        reduced = all_reduce(counts)
        counts = counts if reduced is None else reduced
    n, nb = counts.shape
    c = counts.to(torch.float64)
    m = int(counts[0].sum())
    if m == 0:
        raise ValueError("QB histogram holds no tokens; skip the update for this step instead")
    if q is None:
        if k is None:
            raise ValueError("qb_update_histogram needs q or k")
        q = qb_target(m, k, n)
    r = _kth_largest_rank(q, m)
    above = c.flip(1).cumsum(1).flip(1)  # [n, nb]: margins in bin b or higher
    b_star = ((above >= r).sum(1) - 1).clamp_(0, nb - 1)  # highest bin whose "at or above" count reaches r
    in_bin = c.gather(1, b_star[:, None]).squeeze(1)
    higher = above.gather(1, b_star[:, None]).squeeze(1) - in_bin  # margins strictly above the crossing bin
    rank_in_bin = r - higher  # 1 <= rank_in_bin <= in_bin
    width = (hi - lo) / nb
    top_edge = lo + (b_star.to(torch.float64) + 1) * width
    value = top_edge - (rank_in_bin - 0.5) / in_bin * width
    b_hat = -value
    if center:
        b_hat = b_hat - b_hat.mean()
    return b_hat.to(torch.float32)


def qb_update_histogram_from_scores(scores: torch.Tensor, bias: torch.Tensor, k: int, n_bins: int = 512,
                                    all_reduce: AllReduce | None = None, center: bool = True) -> torch.Tensor:
    """Convenience: bin one batch with the default range, optionally all-reduce, read the update. Returns bias [n].

    Example: b = qb_update_histogram_from_scores(s, b, 4, all_reduce=lambda c: dist.all_reduce(c))
    """
    lo, hi = qb_default_range(bias)
    counts = qb_histogram_counts(scores, bias, k, n_bins, lo, hi)
    return qb_update_histogram(counts, lo, hi, k=k, all_reduce=all_reduce, center=center).to(bias.dtype)


def loss_free_update(loads: torch.Tensor, bias: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """Loss-Free Balancing step (Wang et al., arXiv 2408.15664): b_i <- b_i + gamma * sign(mean(c) - c_i).

    Args: loads [n] tokens per expert (any numeric dtype); bias [n]; gamma the update rate.
    Returns: new bias [n] in bias's dtype. Example: loss_free_update(torch.tensor([3, 1]), torch.zeros(2)) ==
    tensor([-0.001, 0.001])
    """
    if loads.shape != bias.shape:
        raise ValueError(f"loads {tuple(loads.shape)} and bias {tuple(bias.shape)} must have the same shape [n]")
    c = loads.to(_fdtype(bias))
    return (bias + gamma * torch.sign(c.mean() - c)).to(bias.dtype)


def router_stats(topk_idx: torch.Tensor, n_experts: int, all_reduce: AllReduce | None = None) -> dict:
    """Load statistics of one routing.

    Args: topk_idx [N, K] expert ids; n_experts n; all_reduce optional hook summing the loads over ranks.
    Returns: dict(load [n] int64 tokens per expert, max_violation = max_j load_j / mean - 1 (MaxVio, arXiv
    2408.15664), cv = population std / mean), the last two as 0-d fp32 tensors (call .item() to log).

    Example: router_stats(torch.tensor([[0], [0], [1], [1]]), 2)["cv"] == 0
    """
    load = torch.bincount(topk_idx.reshape(-1), minlength=n_experts)
    if load.numel() != n_experts:
        raise ValueError(f"topk_idx holds expert ids >= n_experts ({n_experts})")
    if all_reduce is not None:
        reduced = all_reduce(load)
        load = load if reduced is None else reduced
    lf = load.to(torch.float32)
    mean = lf.mean()
    if mean == 0:
        zero = torch.zeros((), device=lf.device)
        return {"load": load, "max_violation": zero, "cv": zero}
    return {"load": load, "max_violation": lf.max() / mean - 1, "cv": lf.std(correction=0) / mean}
